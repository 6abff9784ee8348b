"""Running the network: the engine loader, the executor seam, the model runner with its KV cache, step
inputs, memory plan and CUDA graphs, and the kernels' settings and stored binaries. Imports the core and
sampling, never the engine."""
