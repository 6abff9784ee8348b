"""`kiln triton-repo`: a Triton Inference Server model repository (Python backend) for an engine."""

from __future__ import annotations

import argparse

_BOOLS = {"true": True, "false": False}


def _bool(text: str) -> bool:
    if text.lower() not in _BOOLS:
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return _BOOLS[text.lower()]


def register(sub: argparse._SubParsersAction) -> None:
    from kiln.commands.runtime_args import add_speculative_args
    from kiln.serve.tritonserver.repository import LAYOUTS, SCHEDULER_POLICIES

    p = sub.add_parser(
        "triton-repo", help="write a Triton Inference Server model repository for an engine",
        description="Write REPO/NAME/config.pbtxt and REPO/NAME/1/model.py: a decoupled Triton Python-backend "
                    "model that serves the engine with kiln's in-flight batching, with the tensors of "
                    "TensorRT-LLM's Triton ensemble (text_input, max_tokens, stream, ... -> text_output). "
                    "Serve it with `tritonserver --model-repository REPO`. REPO/NAME/1/kiln_env.json records "
                    "where model.py finds kiln: this Python's site directories (unless --no-site-path) after "
                    "the --python-path directories.")
    p.add_argument("--engine", required=True, help="engine directory made by `kiln build`")
    p.add_argument("--output", required=True, metavar="REPO", help="model repository directory (created if needed)")
    p.add_argument("--model-name", default=None, metavar="NAME",
                   help="the model's name in Triton (default: the engine directory's name)")
    p.add_argument("--max-batch-size", type=int, default=None, metavar="N",
                   help="requests per engine step and rows per Triton request (default and most: the engine's)")
    p.add_argument("--kv-cache-free-gpu-mem-fraction", type=float, default=0.9, metavar="F",
                   help="share of the GPU memory left free after loading the weights that the KV cache takes "
                        "(CUDA engines; default 0.9)")
    p.add_argument("--enable-kv-cache-reuse", type=_bool, default=True, metavar="true|false",
                   help="prefix caching: reuse the KV blocks of earlier prompts (default true)")
    p.add_argument("--batch-scheduler-policy", choices=SCHEDULER_POLICIES, default="max_utilization",
                   help="max_utilization: admit every request at once, preempting the newest when KV blocks "
                        "run short; guaranteed_no_evict: admit a request only when its prompt + max_tokens fits "
                        "beside the running ones (default max_utilization)")
    p.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters through TensorRT-LLM's inputs lora_task_id, lora_weights and "
                        "lora_config (the adapter comes with a task's first request)")
    p.add_argument("--max-loras", type=int, default=None, metavar="N",
                   help="LoRA adapters on the device at once, and the most one step mixes (runtime default 4)")
    p.add_argument("--max-lora-rank", type=int, default=None, metavar="R",
                   help="largest LoRA rank (adapter_size) served (runtime default 16)")
    p.add_argument("--max-cpu-loras", type=int, default=None, metavar="M",
                   help="LoRA adapters kept in host memory (runtime default 2 * max_loras)")
    p.add_argument("--kv-cache-host-memory-bytes", type=int, default=None, metavar="BYTES",
                   help="host memory the prefix cache's evicted KV blocks move to and come back from, over all "
                        "tensor-parallel ranks (the runtime's --kv-offloading-size; default 0: off)")
    p.add_argument("--kv-offloading-dir", default=None, metavar="DIR",
                   help="the prefix cache's disk tier below the host memory (needs --kv-cache-host-memory-bytes)")
    p.add_argument("--kv-offloading-disk-size", type=float, default=None, metavar="GIB",
                   help="GiB the disk tier may hold (runtime default 10)")
    add_speculative_args(p)
    p.add_argument("--python-path", action="append", default=[], metavar="DIR",
                   help="a directory model.py puts first on the Python backend's sys.path (repeatable), e.g. one "
                        "made by `pip install --target DIR \"numpy<2\"` for a backend stub built for numpy 1")
    p.add_argument("--no-site-path", dest="record_site", action="store_false",
                   help="do not record this Python's site directories (kiln is installed in the backend's own "
                        "environment, e.g. inside Triton's container)")
    p.add_argument("--layout", choices=LAYOUTS, default="single",
                   help="single: one model (REPO/NAME); ensemble: TensorRT-LLM backend's models preprocessing, "
                        "tensorrt_llm (the engine, token ids in and out), postprocessing, ensemble and "
                        "tensorrt_llm_bls, for clients that address them by name (default single)")
    p.add_argument("--force", action="store_true", help="replace an existing REPO/NAME")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from kiln.commands.runtime_args import speculative_config_of_args
    from kiln.serve.tritonserver.repository import write_repository

    model = write_repository(
        args.engine, args.output, model_name=args.model_name, max_batch_size=args.max_batch_size,
        batch_scheduler_policy=args.batch_scheduler_policy,
        kv_cache_free_gpu_mem_fraction=args.kv_cache_free_gpu_mem_fraction,
        enable_kv_cache_reuse=args.enable_kv_cache_reuse, force=args.force, python_path=args.python_path,
        record_site=args.record_site, enable_lora=args.enable_lora, max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank, max_cpu_loras=args.max_cpu_loras, layout=args.layout,
        kv_cache_host_memory_bytes=args.kv_cache_host_memory_bytes, kv_offloading_dir=args.kv_offloading_dir,
        kv_offloading_disk_size=args.kv_offloading_disk_size, speculative_config=speculative_config_of_args(args))
    repo = model.model_dir.parent
    print(f"wrote {model.config_file} (python backend, decoupled, max_batch_size {model.max_batch_size}, "
          f"{model.instance_kind})")
    print(f"wrote {model.model_file}")
    for other in model.layout_models:
        if other != model.model_dir:
            print(f"wrote {other}")
    if model.python_path:
        print(f"model.py adds to the Python backend's sys.path: {', '.join(model.python_path)}")
    print(f"serve it with: tritonserver --model-repository {repo}  (the Python backend's interpreter needs "
          f"numpy<2 with Triton's stubs built for numpy 1)")
    return 0
