import sys, time
sys.path.insert(0, "tests")
from pathlib import Path
from model_factory import make_checkpoint
from kiln.builder.build import build_engine
from kiln.builder.build_config import BuildConfig
from kiln.runtime import LLM, SamplingParams
t = Path("/tmp/shut"); ck, _ = make_checkpoint(t / "ckpt", "LlamaForCausalLM")
e = build_engine(ck, t / "tp2", BuildConfig(device="cuda", tp_size=2, max_batch_size=8, max_seq_len=256), progress=False)
for i in range(2):
    a = time.time(); llm = LLM(e, num_kv_blocks=64); b = time.time()
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=8, temperature=0))[0].token_ids
    c = time.time(); llm.shutdown(); d = time.time()
    print(f"SHUT run {i}: start {b-a:.1f}s generate {c-b:.2f}s shutdown {d-c:.2f}s tokens {out}", flush=True)
