"""The ranges of the quantized activations, shared by the references (quant_linear.py, fp8_block_linear.py)
and the Triton kernels (triton_scaled_linear.py, triton_norm_quant.py), so a kernel module never imports the
reference's module for them."""

FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
INT8_MAX = 127.0
# Floor of a dynamic per-token scale: an all-zero row would otherwise divide 0 by 0 (NaN); with the floor it
# quantizes to zeros and gives zeros.
MIN_DYNAMIC_SCALE = 1e-12
