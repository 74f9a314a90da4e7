"""Export a run's checkpoint as a Hugging Face model directory (transformers, SGLang, the Hub).

    python launch/export_hf.py RUN_DIR --out DIR [--step N] [--dtype bfloat16] [--max-shard-size 5GB]

RUN_DIR is a run's `run.output_dir` (the newest complete checkpoint under its `checkpoints/`),
or one `checkpoints/step_NNNNNN` directory. DIR gets config.json, model*.safetensors (sharded
with an index past --max-shard-size) and the base model's tokenizer and generation config.
One process on CPU, whatever TP the run trained with; see `tide_megatron/models/hf_export.py`.
Exits 1 with one line saying what is wrong when the checkpoint is missing, incomplete or corrupt.
"""

from __future__ import annotations

import argparse
import os
import sys

# Before torch is imported: the export runs on CPU (a GPU's memory would bound the model size at
# TP=1, and the work is reading and writing files), one process, a few threads.
os.environ["CUDA_VISIBLE_DEVICES"] = ""
os.environ.setdefault("OMP_NUM_THREADS", "4")


def parse_args(argv: list[str]) -> argparse.Namespace:
    from tide_megatron.models.hf_export import DEFAULT_MAX_SHARD_SIZE, EXPORT_DTYPES

    parser = argparse.ArgumentParser(
        prog="export_hf.py",
        description="Turn a run's Megatron checkpoint into a Hugging Face model directory that "
                    "transformers (AutoModelForCausalLM / Qwen3VLForConditionalGeneration) and SGLang load.")
    parser.add_argument("run", metavar="RUN_DIR",
                        help="the run's output directory (run.output_dir), its checkpoints/ directory, or one "
                             "checkpoints/step_NNNNNN directory")
    parser.add_argument("--out", required=True, metavar="DIR", help="the Hugging Face directory to write")
    parser.add_argument("--step", type=int, default=None,
                        help="export this step's checkpoint (default: the newest complete one, named by "
                             "checkpoints/latest)")
    parser.add_argument("--base-model", default=None, metavar="DIR",
                        help="the Hugging Face directory the run started from (default: model.path of the run's "
                             "config.json, or RUN_DIR/initial_model for a random-init run)")
    parser.add_argument("--dtype", default="auto", choices=EXPORT_DTYPES,
                        help="dtype of the exported weights (default auto: the dtype the run trained in)")
    parser.add_argument("--max-shard-size", default=DEFAULT_MAX_SHARD_SIZE, metavar="SIZE",
                        help="largest safetensors file, e.g. 5GB, 500MB, 2GiB (default %(default)s)")
    parser.add_argument("--overwrite", action="store_true", help="replace DIR if it exists and is not empty")
    parser.add_argument("--deep-verify", action="store_true",
                        help="hash every checkpoint file against its manifest (default: the metadata and small "
                             "files, and the sizes of the large shards)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import warnings

    from tide_megatron.models.hf_export import ExportError, export_run
    from tide_megatron.trainer.checkpoint import CheckpointError

    warnings.filterwarnings("ignore")  # Megatron's and transformers' start-up chatter
    try:
        export_run(args.run, args.out, step=args.step, base_model=args.base_model, dtype=args.dtype,
                   max_shard_size=args.max_shard_size, overwrite=args.overwrite, deep_verify=args.deep_verify,
                   progress=lambda line: print(line, flush=True))
    except (ExportError, CheckpointError, FileNotFoundError) as exc:
        print(f"export_hf.py: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
