"""Elastic fine-tuning of a Llama-architecture causal LM with ``elastic_events``.

One script for a laptop CPU and for GPU nodes, fixed-size or elastic:

    # one process (no torch.distributed environment): world size 1, CPU fp32 or one GPU bf16
    python examples/llama_finetune/train.py --model tiny --steps 200
    # fixed size: torchrun (or hyperpodrun, the same flags)
    torchrun --standalone --nproc-per-node 2 examples/llama_finetune/train.py --steps 200
    # elastic: 1 to 8 nodes, grows when capacity appears, shrinks when a node leaves
    hyperpodrun --nnodes 1:8 --nproc-per-node 8 --rdzv-backend etcd --rdzv-endpoint etcd:2379 \\
        --rdzv-id llama-ft examples/llama_finetune/train.py --init-from /models/Meta-Llama-3-8B \\
        --fsdp --data corpus.jsonl --seq-len 4096 --global-batch 256 --micro-batch 2 --lr 2e-5 \\
        --run-dir /fsx/llama-ft --steps 2000

What makes it elastic (each piece from ``elastic_events``):

* ``ElasticTraining`` owns model, optimizer, schedule, step and process group; with
  ``elastic_event_detected()`` once per optimizer step on every rank, its
  ``reconfigure()`` carries the rank into the new world in place (survivors keep their
  state, newcomers receive it from peers, see ``docs/checkpointless.md``), or, when the
  launcher asks for a restart, saves a checkpoint and the script exits 0;
* DCP checkpoints (model, optimizer, scheduler, data position, step, RNG) loaded and
  resharded at any world size on start;
* exactly-once data: ``ElasticSampler``'s state is the job's global position in the
  epoch, so after a resize the rest of the epoch is split over the new ranks;
* constant global batch: ``--global-batch`` samples per step at any world size, cut into
  micro-batches of at most ``--micro-batch`` per rank; each micro-batch's summed token
  loss is divided by the step's job-wide token count (one scalar all-reduce), so the
  gradient is that of one process over the whole global batch; the LR does not change;
  ``--deterministic-reduce`` makes it the same bits at any world size (each sample's gradient
  summed in an order fixed by its place in the batch), to compare runs exactly.

The default data is CPython's language reference (``corpus.py``), tokenised once into
a memory-mapped file under ``--data-cache``. Under hyperpodrun, ``elastic_events`` adds the
trainer's ``first_step``, ``checkpoint_saved``, ``checkpoint_loaded``, ``group_torn_down``,
``group_up`` and ``hydrated`` records to the
launchers' event log, so each scale event's downtime can be read off it (``demo.py``).
The script reads top to bottom: config, setup, data, model, loop.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from corpus import write_default_corpus
from hf_checkpoint import CONFIG_FILE, HFCheckpointError, config_from_hf, load_hf_llama
from model import IGNORE_INDEX, Llama, LlamaConfig, LlamaConfigError
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torchdata.stateful_dataloader import StatefulDataLoader

from elastic_events import (
    ElasticConfig,
    ElasticTraining,
    ElasticTrainingError,
    HSDPConfig,
    clip_grad_norm_,
    init_process_group,
    leave_on_sigterm,
    restart_reason,
    state_will_be_loaded,
)
from elastic_events.checkpoint import CheckpointConfig, Checkpointer, CheckpointError
from elastic_events.contract import RankContext
from elastic_events.data.batching import BatchPlan, global_token_count, loss_scale, sum_in_batch_order
from elastic_events.data.dataset import ByteTokenizer, DatasetError, TokenDataset, Tokenizer, build_token_dataset
from elastic_events.data.sampler import ElasticSampler, ElasticSamplerError, GlobalStep
from elastic_events.rounds.mesh import plan_layout
from elastic_events.scale_config import DEFAULT_SCHEMA, ScaleConfigError, load_scale_config

SCALE_CONFIG_KEYS = ("micro_batch", "num_workers", "prefetch_factor")  # what --scale-config may override


class TrainError(RuntimeError):
    """A failure the script reports as one line and a non-zero exit."""


class ConfigError(TrainError, ValueError):
    """A command-line value is invalid; the message names the flag."""


# Failures that are fully described by their message: one line on stderr, exit status 2.
REPORTED_ERRORS = (
    TrainError,
    ScaleConfigError,
    HFCheckpointError,
    DatasetError,
    ElasticSamplerError,
    CheckpointError,
    ElasticTrainingError,
)


# ----------------------------------------------------------------------------- config


def default_data_cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hyperpodrun" / "llama_finetune"


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Every setting of a run; built from the command line by :func:`parse_args`."""

    model: str | None = None  # preset name; None: "tiny", or the --init-from directory's config
    init_from: Path | None = None
    data: tuple[Path, ...] = ()  # .txt / .jsonl files; empty: the default corpus
    data_cache: Path = dataclasses.field(default_factory=default_data_cache)
    seq_len: int = 256
    global_batch: int = 8
    micro_batch: int = 4
    steps: int = 200
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    fsdp: bool = False
    hsdp: bool = False  # FSDP2 on a ("replicate", "shard") mesh: shard inside a node, replicate across nodes
    hsdp_shard_size: int | None = None  # ranks per shard group; None: the ranks of one node (LOCAL_WORLD_SIZE)
    deterministic_reduce: bool = False
    device: str = "auto"
    dtype: str = "auto"
    num_workers: int = 2
    prefetch_factor: int = 2
    scale_config: Path | None = None
    run_dir: Path | None = None
    ckpt_dir: Path | None = None
    ckpt_every: int = 0
    keep_checkpoints: int = 2
    async_checkpoint: bool = False
    log_every: int = 10
    metrics: Path | None = None
    sample_log: Path | None = None
    save_final: Path | None = None
    min_step_time: float = 0.0
    timeout_s: float = 600.0
    commit_check: bool = True  # ElasticConfig.commit_check: an optimizer step only after its collectives completed

    def __post_init__(self) -> None:
        positive = ("seq_len", "global_batch", "micro_batch", "keep_checkpoints", "log_every", "prefetch_factor")
        non_negative = ("steps", "warmup_steps", "ckpt_every", "num_workers", "seed")
        for name in positive + non_negative:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (name in positive):
                raise ConfigError(f"--{_flag(name)} must be an integer >= {int(name in positive)}, got {value!r}")
        for name in ("lr", "timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"--{_flag(name)} must be > 0, got {getattr(self, name)!r}")
        for name in ("weight_decay", "grad_clip", "min_step_time"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"--{_flag(name)} must be >= 0, got {getattr(self, name)!r}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"--min-lr-ratio must be in [0, 1], got {self.min_lr_ratio!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"--device must be auto, cpu or cuda, got {self.device!r}")
        if self.dtype not in ("auto", "fp32", "bf16", "fp64"):
            raise ConfigError(f"--dtype must be auto, fp32, bf16 or fp64, got {self.dtype!r}")
        if self.deterministic_reduce and self.sharded:
            raise ConfigError(
                "--deterministic-reduce needs DDP or one process: FSDP reduce-scatters in an order set by the world size"
            )
        if self.fsdp and self.hsdp:
            raise ConfigError("--fsdp and --hsdp exclude each other: --hsdp is FSDP2 sharded inside each replica")
        if self.hsdp_shard_size is not None and not self.hsdp:
            raise ConfigError("--hsdp-shard-size needs --hsdp")
        if self.hsdp_shard_size is not None and self.hsdp_shard_size < 1:
            raise ConfigError(f"--hsdp-shard-size must be an integer >= 1, got {self.hsdp_shard_size!r}")
        if self.model is not None and self.init_from is not None:
            raise ConfigError("--model and --init-from exclude each other: the model is --init-from's config.json")
        if self.init_from is not None and not (self.init_from / CONFIG_FILE).is_file():
            raise ConfigError(
                f"--init-from {self.init_from}: no {CONFIG_FILE} (expected a Hugging Face Llama directory)"
            )
        for path in self.data:
            if not path.is_file():
                raise ConfigError(f"--data {path}: no such file")
        if self.scale_config is not None and not self.scale_config.is_file():
            raise ConfigError(f"--scale-config {self.scale_config}: no such file")

    @property
    def sharded(self) -> bool:
        """FSDP2, over the world (--fsdp) or inside each replica (--hsdp)."""
        return self.fsdp or self.hsdp

    def checkpoint_dir(self, run_id: str) -> Path:
        """``--ckpt-dir``, else ``--run-dir/checkpoints``, else a per-job folder in the data cache."""
        if self.ckpt_dir is not None:
            return self.ckpt_dir
        if self.run_dir is not None:
            return self.run_dir / "checkpoints"
        model = self.model or (self.init_from.name if self.init_from is not None else "tiny")
        return self.data_cache / "runs" / f"{model}-{run_id}" / "checkpoints"


def _flag(name: str) -> str:
    return {"timeout_s": "timeout"}.get(name, name).replace("_", "-")


def parse_args(argv: Sequence[str] | None = None) -> TrainConfig:
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model",
        help="preset: tiny, llama-25m, llama-125m, llama-300m (CPU), llama3.2-1b, llama3-8b, llama3.1-8b, "
        "llama3-70b [tiny]",
    )
    p.add_argument("--init-from", type=Path, help="Hugging Face Llama directory (config.json, *.safetensors)")
    p.add_argument("--data", type=Path, action="append", default=[], help=".txt or .jsonl file (repeatable)")
    for name in ("data_cache", "scale_config", "run_dir", "ckpt_dir", "metrics", "sample_log", "save_final"):
        p.add_argument(
            f"--{_flag(name)}", dest=name, type=Path, default=fields[name].default if name != "data_cache" else None
        )
    for name in (
        "seq_len",
        "global_batch",
        "micro_batch",
        "steps",
        "warmup_steps",
        "seed",
        "num_workers",
        "prefetch_factor",
        "ckpt_every",
        "keep_checkpoints",
        "log_every",
    ):
        p.add_argument(f"--{_flag(name)}", dest=name, type=int, default=fields[name].default)
    for name in ("lr", "min_lr_ratio", "weight_decay", "grad_clip", "min_step_time", "timeout_s"):
        p.add_argument(f"--{_flag(name)}", dest=name, type=float, default=fields[name].default)
    p.add_argument("--fsdp", action="store_true", help="FSDP2 fully_shard per block and root (default: DDP)")
    p.add_argument(
        "--hsdp",
        action="store_true",
        help="HSDP: FSDP2 sharded over each node's ranks, replicated across nodes (a node joins or leaves as a replica)",
    )
    p.add_argument(
        "--hsdp-shard-size", type=int, default=None, help="--hsdp: ranks per shard group [the ranks of one node]"
    )
    p.add_argument(
        "--deterministic-reduce",
        action="store_true",
        help="each sample's gradient alone, summed in an order fixed by its place in the global batch: the same bits "
        "at every world size (to compare elastic runs exactly; one forward per sample, a gather of partial sums)",
    )
    p.add_argument("--async-checkpoint", action="store_true", help="periodic saves write in the background")
    p.add_argument(
        "--no-commit-check",
        dest="commit_check",
        action="store_false",
        help="take each optimizer step without first checking that the step's collectives completed (under "
        "hyperpodrun; measures the check's cost)",
    )
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "fp32", "bf16", "fp64"),
        help="compute dtype [bf16 on CUDA]; fp64: weights and math in float64 (to compare runs closely)",
    )
    args = vars(p.parse_args(argv))
    args["data"] = tuple(args["data"])
    args["data_cache"] = args["data_cache"] or default_data_cache()
    return TrainConfig(**args)


def append_jsonl(path: str | os.PathLike[str], record: dict[str, Any]) -> None:
    """One ``os.write`` of one line with O_APPEND: lines of concurrent writers never interleave."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, (json.dumps(record) + "\n").encode())
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------ setup


@dataclasses.dataclass(frozen=True, kw_only=True)
class Runtime:
    """Where this process runs: rank, world, device and numerics."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    compute_dtype: torch.dtype
    distributed: bool  # a process group exists (torchrun / hyperpodrun)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def resized(self, elastic: ElasticTraining) -> Runtime:
        """This runtime in ``elastic``'s current world (after start or an in-place resize)."""
        return dataclasses.replace(
            self, rank=elastic.rank, world_size=elastic.world_size, distributed=elastic.distributed
        )


def setup_runtime(cfg: TrainConfig) -> Runtime:
    """Join the process group if launched by torchrun/hyperpodrun; pick device and dtype.

    A parked joiner (``HYPERPODRUN_PARKED=1``, no ``RANK`` yet) joins later, at admission.
    """
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is available")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    parked = os.environ.get("HYPERPODRUN_PARKED") == "1"  # its GPU is made current at admission, not while parked
    if use_cuda and not parked:
        torch.cuda.set_device(device)
    if cfg.deterministic_reduce:  # and the same kernels' choices on every rank (cuBLAS: before its first call)
        if use_cuda:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    distributed = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if distributed:  # torch's call, formed as the rank's first round: a repair can end a gloo wait in it
        init_process_group(
            "nccl" if use_cuda else "gloo",
            timeout=timedelta(seconds=cfg.timeout_s),
            device_id=device if use_cuda else None,
        )
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}.get(
        cfg.dtype, torch.bfloat16 if use_cuda else torch.float32
    )
    return Runtime(
        rank=dist.get_rank() if distributed else 0,
        local_rank=local_rank,
        world_size=dist.get_world_size() if distributed else 1,
        device=device,
        compute_dtype=dtype,
        distributed=distributed,
    )


def resolve_overrides(cfg: TrainConfig, world_size: int) -> TrainConfig:
    """``cfg`` with the ``--scale-config`` overrides for ``world_size`` applied."""
    if cfg.scale_config is None:
        return cfg
    schema = {key: DEFAULT_SCHEMA[key] for key in SCALE_CONFIG_KEYS}
    overrides = load_scale_config(cfg.scale_config, schema=schema).resolve(world_size)
    return dataclasses.replace(cfg, **overrides)


# ------------------------------------------------------------------------------- data


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` through the ``tokenizers`` package (the Tokenizer protocol)."""

    def __init__(self, path: Path, eos_id: int | None) -> None:
        try:
            from tokenizers import Tokenizer as _Tokenizer
        except ImportError:
            raise TrainError(
                f"{path} needs the 'tokenizers' package: pip install tokenizers "
                "(or pip install 'hyperpodrun[hf]'), or remove the file to train on bytes"
            ) from None
        self._tokenizer = _Tokenizer.from_file(str(path))
        self.name = f"hf-tokenizers-{hashlib.sha256(path.read_bytes()).hexdigest()[:16]}"
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        candidates = (self._tokenizer.token_to_id(t) for t in ("<|end_of_text|>", "</s>", "<|endoftext|>"))
        eos_id = eos_id if eos_id is not None else next((i for i in candidates if i is not None), None)
        if eos_id is None:
            raise TrainError(f"{path}: no end-of-sequence token (set eos_token_id in config.json)")
        self.eos_id = eos_id

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids))


def load_tokenizer(init_from: Path | None) -> Tokenizer:
    """The checkpoint's ``tokenizer.json`` when there is one, else UTF-8 bytes."""
    if init_from is None or not (init_from / "tokenizer.json").is_file():
        return ByteTokenizer()
    eos = json.loads((init_from / CONFIG_FILE).read_text()).get("eos_token_id")
    return HFTokenizer(init_from / "tokenizer.json", eos[0] if isinstance(eos, list) else eos)


def prepare_dataset(cfg: TrainConfig, tokenizer: Tokenizer, rt: Runtime) -> TokenDataset:
    """Tokenise once into ``--data-cache``, in three turns separated by barriers: global rank 0,
    then the first rank of every other node (whose cache may be node-local, else it finds the
    build done), then the other ranks, which only open the result."""
    turn = 0 if rt.is_main else 1 if rt.local_rank == 0 else 2
    for _ in range(turn):
        rt.barrier()  # the earlier turns build
    sources = cfg.data or tuple(write_default_corpus(cfg.data_cache / "corpus"))  # unchanged text: no write
    key = hashlib.sha256("\0".join(str(p.resolve()) for p in sources).encode()).hexdigest()[:12]
    out = cfg.data_cache / f"tokens-{tokenizer.name}-{key}"
    dataset = build_token_dataset(sources, out, tokenizer, seq_len=cfg.seq_len, lock_timeout=cfg.timeout_s)
    for _ in range(2 - turn):
        rt.barrier()  # the later turns may go
    return dataset


# ------------------------------------------------------------------------------ model


def model_config(cfg: TrainConfig) -> LlamaConfig:
    if cfg.init_from is not None:
        path = cfg.init_from / CONFIG_FILE
        return config_from_hf(json.loads(path.read_text()), source=str(path))
    try:
        return LlamaConfig.from_name(cfg.model or "tiny")
    except LlamaConfigError as exc:
        raise ConfigError(f"--model: {exc}") from None


def parallelize(cfg: TrainConfig, model: torch.nn.Module, rt: Runtime, mesh: Any = None) -> torch.nn.Module:
    """The bare Llama made ready for the current world (ElasticTraining's ``wrap``).

    ``--fsdp``: FSDP2 ``fully_shard`` per block and root, on the current group; ``--hsdp``: the same on
    ``mesh``, the round's ``("replicate", "shard")`` mesh that ElasticTraining builds and hands over. A model on
    ``meta`` (a fresh build) is then materialised on ``rt.device`` in fp32 (master weights)
    and initialised from ``--seed``, unless ElasticTraining loads the state it kept over it right after
    (a sharded model rebuilt at an event); a survivor's DDP model keeps its weights. Otherwise DDP
    when a process group is up.
    """
    distributed = dist.is_initialized()
    if cfg.sharded:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if not distributed:
            raise ConfigError(
                f"--{'hsdp' if cfg.hsdp else 'fsdp'} needs a process group: launch with torchrun or hyperpodrun"
            )
        bf16 = rt.compute_dtype == torch.bfloat16
        kwargs: dict[str, Any] = {"mesh": mesh} if cfg.hsdp else {}
        if bf16:
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.layers:
            fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)  # the root keeps tok_embeddings, shared by tied embeddings
    fresh = any(p.is_meta for p in model.parameters())
    if fresh:
        model.to_empty(device=rt.device)
        if not state_will_be_loaded():  # a rebuild at an event: the kept state is loaded next
            model.init_weights(seed=cfg.seed)
    if distributed and not cfg.sharded:  # a survivor's or hydrated replica is already rank 0's: no broadcast
        ids = [rt.device.index] if rt.device.type == "cuda" else None
        model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=ids, gradient_as_bucket_view=True, init_sync=fresh
        )
    return model


def parallelism(cfg: TrainConfig, elastic: ElasticTraining) -> str:
    """How the model is parallelised, for the start line."""
    if cfg.hsdp and elastic.mesh is not None:
        replicas, shards = elastic.mesh.shape
        return f"HSDP {replicas} replica(s) x {shards} shard(s)"
    return "FSDP2" if cfg.fsdp else "DDP" if elastic.distributed else "single process"


def load_pretrained(cfg: TrainConfig, model: torch.nn.Module, rt: Runtime) -> None:
    """The Hugging Face weights of ``--init-from`` (read by rank 0 and broadcast)."""
    if rt.distributed:
        full = load_hf_llama(cfg.init_from, dtype=torch.float32)[1] if rt.is_main else {}
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(model, full, options=options)
    else:
        model.load_state_dict(load_hf_llama(cfg.init_from, dtype=torch.float32)[1], strict=True)


@contextlib.contextmanager
def gradient_sync(model: torch.nn.Module, enabled: bool) -> Iterator[None]:
    """Reduce gradients only at the last micro-batch of a step (DDP ``no_sync`` / FSDP2 flag)."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel) and not enabled:
        with model.no_sync():
            yield
        return
    if hasattr(model, "set_requires_gradient_sync"):  # an FSDP2 module
        model.set_requires_gradient_sync(enabled)
    yield


def build_optimizer(cfg: TrainConfig, model: torch.nn.Module, rt: Runtime) -> torch.optim.Optimizer:
    """AdamW, no decay on norm weights; the same LR at every world size.

    Its fused kernel on CUDA and on CPU alike: one op a param group. On a sharded model that is also one
    DTensor sharding propagation a group where the per-parameter loop (CPU's default) computes one per op
    and shape: on a mesh new to the process the tiny model's first HSDP optimizer step took 0.21-0.33 s
    with the loop here against 0.12-0.14 s, and every later one 35-47 ms against 7 ms. The kernel is
    elementwise, so a shard's values do not depend on where the shard starts."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    fused = rt.device.type in ("cuda", "cpu")
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, fused=fused)


def build_scheduler(cfg: TrainConfig, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    """Warmup, then cosine to ``lr * min_lr_ratio``."""

    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def describe_plan(plan: BatchPlan) -> str:
    """``"8 = 2 x [3] + 1 x [2]"``: the global batch and each rank's micro-batches, grouped."""
    groups: list[tuple[list[int], int]] = []
    for rank in range(plan.world_size):
        sizes = plan.micro_batches(rank)
        if groups and groups[-1][0] == sizes:
            groups[-1] = (sizes, groups[-1][1] + 1)
        else:
            groups.append((sizes, 1))
    return f"{plan.global_batch} = " + " + ".join(f"{n} x {sizes}" for sizes, n in groups)


# ------------------------------------------------------------------------------- loop


def train_step(
    model, optimizer, scheduler, batch: GlobalStep, rt: Runtime, cfg: TrainConfig
) -> tuple[torch.Tensor, int]:
    """One optimizer step on this rank's share of the global batch.

    Every micro-batch's summed token loss is scaled by ``world / global tokens`` (one
    scalar all-reduce counts them), so the averaged gradient is the mean over the whole
    global batch, as in one process (``--deterministic-reduce``: with the same bits).
    Returns this rank's summed loss and the job's tokens.
    """
    local_tokens = sum(int((mb["labels"] != IGNORE_INDEX).sum()) for mb in batch.micro_batches)
    global_tokens = global_token_count(local_tokens, device=rt.device)
    if cfg.deterministic_reduce:
        loss_sum = batch_order_gradients(model, batch, rt, global_tokens)
    else:
        loss_sum = accumulated_gradients(model, batch, rt, cfg, global_tokens)
    if cfg.grad_clip > 0:  # FSDP/HSDP: the norm from the local shards, no DTensor op to propagate on a new mesh
        clip_grad_norm_(model.parameters(), cfg.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    return loss_sum, global_tokens


def accumulated_gradients(model, batch: GlobalStep, rt: Runtime, cfg: TrainConfig, global_tokens: int) -> torch.Tensor:
    """Micro-batches accumulated into ``.grad``, reduced by DDP/FSDP at the last one; this rank's summed loss."""
    scale = loss_scale(1, global_tokens, world_size=rt.world_size, grad_averaged=rt.distributed)  # DDP/FSDP average
    autocast = rt.compute_dtype == torch.bfloat16 and not cfg.sharded  # FSDP2 casts by its MixedPrecisionPolicy
    loss_sum = torch.zeros((), device=rt.device)
    for i, mb in enumerate(batch.micro_batches):
        cast = torch.autocast(rt.device.type, dtype=rt.compute_dtype) if autocast else contextlib.nullcontext()
        with gradient_sync(model, i == len(batch.micro_batches) - 1), cast:
            out = model(mb["input_ids"].to(rt.device, non_blocking=True), mb["labels"].to(rt.device, non_blocking=True))
            (out.loss.loss_sum * scale).backward()
        loss_sum += out.loss.loss_sum.detach()
    return loss_sum


def batch_order_gradients(model: torch.nn.Module, batch: GlobalStep, rt: Runtime, global_tokens: int) -> torch.Tensor:
    """``--deterministic-reduce``: every sample's gradient alone, summed along a tree fixed by the samples'
    positions in the global batch (``sum_in_batch_order``), then divided by the job's tokens: the same bits at
    any world size, as long as every rank runs the same kernels (same device type, dtype and intra-op threads).
    This rank's summed loss."""
    params = [p for p in model.parameters() if p.requires_grad]
    autocast = rt.compute_dtype == torch.bfloat16
    loss_sum = torch.zeros((), device=rt.device)
    grads = []
    for mb in batch.micro_batches:
        for i in range(len(mb["input_ids"])):
            cast = torch.autocast(rt.device.type, dtype=rt.compute_dtype) if autocast else contextlib.nullcontext()
            with gradient_sync(model, False), cast:  # no DDP all-reduce: the samples' gradients are summed below
                out = model(mb["input_ids"][i : i + 1].to(rt.device), mb["labels"][i : i + 1].to(rt.device))
                out.loss.loss_sum.backward()
            loss_sum += out.loss.loss_sum.detach()
            grads.append([p.grad for p in params])
            for p in params:
                p.grad = None  # the next sample's gradient alone
    total = sum_in_batch_order(grads, batch.plan, like=params)
    torch._foreach_div_(total, global_tokens)
    for p, grad in zip(params, total):
        p.grad = grad
    return loss_sum


def train(cfg: TrainConfig) -> int:
    leave_on_sigterm()  # under hyperpodrun: SIGTERM (Slurm sends it to every process) leaves at the agreed step
    rt = setup_runtime(cfg)
    cfg = resolve_overrides(cfg, rt.world_size)
    if cfg.hsdp and rt.distributed:  # a world of no whole number of replicas: said before the data is tokenised
        local_world = RankContext.from_env().local_world_size
        plan_layout(HSDPConfig(shard_size=cfg.hsdp_shard_size), world_size=rt.world_size, local_world_size=local_world)
    torch.manual_seed(cfg.seed)
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "local")
    say = print if rt.is_main else (lambda *a, **k: None)
    for output in (cfg.metrics, cfg.sample_log, cfg.save_final):
        if output is not None:
            output.parent.mkdir(parents=True, exist_ok=True)

    # Data: tokenised once, then an exactly-once elastic sampler over the current ranks.
    tokenizer = load_tokenizer(cfg.init_from)
    config = model_config(cfg)
    if tokenizer.vocab_size > config.vocab_size:
        raise ConfigError(
            f"the tokenizer has {tokenizer.vocab_size} ids, the model's vocabulary only {config.vocab_size}"
        )
    if cfg.seq_len > config.max_seq_len:
        raise ConfigError(f"--seq-len {cfg.seq_len} exceeds the model's max_seq_len {config.max_seq_len}")
    dataset = prepare_dataset(cfg, tokenizer, rt)
    sampler = ElasticSampler(
        len(dataset),
        global_batch=cfg.global_batch,
        micro_batch=cfg.micro_batch,
        rank=rt.rank,
        world_size=rt.world_size,
        seed=cfg.seed,
    )

    # Model, optimizer, schedule, owned by ElasticTraining: built for this world and loaded from
    # the newest checkpoint (resharded), or, for a parked joiner, received from its peers.
    ckpt = Checkpointer(
        CheckpointConfig(
            dir=cfg.checkpoint_dir(run_id),
            keep_last=cfg.keep_checkpoints,
            async_save=cfg.async_checkpoint,
            timeout_s=cfg.timeout_s,
        )
    )

    def bare_model() -> torch.nn.Module:
        with torch.device("meta"):  # fp64: weights and optimizer state in float64 too (--dtype)
            return Llama(config).to(torch.float64) if rt.compute_dtype == torch.float64 else Llama(config)

    elastic = ElasticTraining(
        model_fn=bare_model,
        wrap=lambda model, mesh=None: parallelize(cfg, model, rt, mesh),  # mesh: --hsdp's, built by ElasticTraining
        optimizer_fn=lambda model: build_optimizer(cfg, model, rt),
        scheduler_fn=lambda optimizer: build_scheduler(cfg, optimizer),
        sampler=sampler,
        checkpointer=ckpt,
        config=ElasticConfig(
            timeout_s=cfg.timeout_s,
            device=str(rt.device),
            commit_check=cfg.commit_check,
            hsdp=HSDPConfig(shard_size=cfg.hsdp_shard_size) if cfg.hsdp else None,
        ),
    ).start()
    rt = rt.resized(elastic)
    say = print if rt.is_main else (lambda *a, **k: None)
    if elastic.resumed_from == "fresh" and cfg.init_from is not None:
        load_pretrained(cfg, elastic.model, rt)
    say(
        f"world {rt.world_size} on {rt.device} ({str(rt.compute_dtype).removeprefix('torch.')}, "
        f"{parallelism(cfg, elastic)}), "
        f"{config.num_params() / 1e6:.1f}M parameters, {len(dataset)} samples of {cfg.seq_len} tokens; "
        f"batch {describe_plan(sampler.plan)}; checkpoints in {ckpt.config.dir}; "
        + (
            f"resumed at step {elastic.step} from {elastic.resumed_from} ({restart_reason()})"
            if elastic.resumed_from != "fresh"
            else "fresh start"
        ),
        flush=True,
    )

    loader = StatefulDataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=cfg.num_workers,
        pin_memory=rt.device.type == "cuda",
        prefetch_factor=cfg.prefetch_factor if cfg.num_workers > 0 else None,
        persistent_workers=cfg.num_workers > 0,  # after an event the new iterator keeps the workers (no respawn)
    )
    world = rt.world_size
    for step in elastic.steps(loader, until=cfg.steps):  # scale events and repairs happen in here, in place
        rt = rt.resized(elastic)
        say = print if rt.is_main else (lambda *a, **k: None)
        if rt.world_size != world:
            say(
                f"world {world} -> {rt.world_size} in place at step {elastic.step}, batch {describe_plan(sampler.plan)}"
            )
            world = rt.world_size
        log = step.number % cfg.log_every == 0 or step.first or step.number == cfg.steps
        t0 = time.perf_counter()
        with step:  # a peer that dies here: this step is abandoned, the rank carried into the repaired round
            loss_sum, global_tokens = train_step(
                elastic.model, elastic.optimizer, elastic.scheduler, step.batch, rt, cfg
            )
            if cfg.min_step_time > 0:
                time.sleep(max(0.0, cfg.min_step_time - (time.perf_counter() - t0)))
            if log and rt.distributed:
                dist.all_reduce(loss_sum)  # the global batch's loss, for the log only
            elastic.extra["tokens_seen"] = elastic.extra.get("tokens_seen", 0) + global_tokens
            step_time, ended = time.perf_counter() - t0, time.time()  # the step, without the save below
            if step.number == cfg.steps or (cfg.ckpt_every and step.number % cfg.ckpt_every == 0):
                elastic.save_checkpoint()  # before the event: in the world that trained the step
        if not step.counted:  # abandoned: the repaired round trains it again
            continue
        if cfg.sample_log is not None:  # trained, even where a peer died after the optimizer step (step.failed)
            ids = torch.cat([mb["sample_id"] for mb in step.batch.micro_batches]).tolist()
            record = {"step": step.number, "rank": rt.rank, "world_size": rt.world_size, "epoch": step.batch.epoch}
            append_jsonl(cfg.sample_log, {**record, "position": step.batch.start, "sample_ids": ids})
        if log and step.failed is None:  # a failed step's loss all-reduce did not complete
            metrics = {
                "ts": ended,
                "step": step.number,
                "loss": loss_sum.item() / global_tokens,
                "world_size": rt.world_size,
                "tokens_per_s": global_tokens / step_time,
                "lr": elastic.scheduler.get_last_lr()[0],
            }
            if (snap := elastic.snapshot_stats())["state_bytes"]:  # --fsdp: in-memory snapshots (bytes)
                metrics.update(
                    snapshot_state_bytes=snap["state_bytes"],
                    snapshot_held_bytes=snap["held_bytes"],
                    snapshot_chain_s=snap["chain_us"] / 1e6,
                )
            say(
                f"step {step.number:5d}/{cfg.steps} | loss {metrics['loss']:.4f} | {metrics['tokens_per_s']:9.0f} tok/s | "
                f"world {rt.world_size} | batch {describe_plan(step.batch.plan)} | lr {metrics['lr']:.2e}",
                flush=True,
            )
            if cfg.metrics is not None and rt.is_main:
                append_jsonl(cfg.metrics, metrics)
    left = elastic.step < cfg.steps  # this node left the job, or saved for a restart: exit 0
    if left:
        say(f"elastic event at step {elastic.step}: leaving (a restart resumes from the checkpoint)", flush=True)
    ckpt.close()
    if not left and cfg.save_final is not None:
        full = get_model_state_dict(elastic.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rt.is_main:
            torch.save(full, cfg.save_final)
    if not left:
        say(f"done: {elastic.step} steps, {elastic.extra.get('tokens_seen', 0)} tokens", flush=True)
    elastic.close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    warnings.filterwarnings("ignore", message="'set_vital' is deprecated")  # torchdata 0.11 on torch >= 2.9
    try:
        return train(parse_args(argv))
    except REPORTED_ERRORS as exc:
        print(f"train.py: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
