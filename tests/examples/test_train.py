"""The Llama fine-tune (examples/llama_finetune/train.py) under hyperpodrun, elastic and fixed-size.

The elastic run goes 1 -> 2 -> 1 ranks (a second launcher joins, then gets SIGTERM) and
must end with the parameters of a plain single-process run of the same seed and steps.

Tolerance: ``atol=ELASTIC_ATOL`` = 1e-5 (rtol 0) on parameters of magnitude up to ~1.
Runs on this machine differ by at most ~1.2e-6 after 48 AdamW steps. Not zero for the
reason the MLP equivalence test gives (``tests/elastic_events/test_equivalence.py``, atol
1e-6 after 16 steps): the global batch's gradient is summed in another order at each
world size (two micro-batches accumulated in ``.grad`` in one process versus per-rank
sums all-reduced by DDP), and float addition is not associative. Here those one-ulp
differences compound over three times as many steps of a deeper model: each step's
parameters feed the next step's gradients, and AdamW's normalised update ``m / sqrt(v)``
turns a relative difference in a small gradient entry into the same relative difference
of a full-size (~lr) update. A lost, repeated or misweighted sample, or a skipped
optimizer or scheduler state, moves the parameters by about one step's update, which is
over 1e-4 even at the end of the cosine schedule (lr 3e-4); the test checks that margin
on the reference run's last two checkpoints.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from elastic_events.data.sampler import epoch_permutation
from support.cluster import wait_until
from support.launch import clean_env, hyperpodrun_cmd, run
from support.ports import free_port

EXAMPLE_DIR = Path(__file__).resolve().parents[2] / "examples" / "llama_finetune"
SRC = Path(__file__).resolve().parents[2] / "src"
TRAIN = EXAMPLE_DIR / "train.py"
if str(EXAMPLE_DIR) not in sys.path:
    sys.path.insert(0, str(EXAMPLE_DIR))

import demo  # noqa: E402
import train  # noqa: E402
from hf_checkpoint import save_hf_llama  # noqa: E402
from model import Llama, LlamaConfig  # noqa: E402

ELASTIC_ATOL = 1e-5
ELASTIC_STEPS, ELASTIC_BATCH, ELASTIC_SEED = 48, 6, 3
SMALL = ("--seq-len", "64", "--global-batch", "6", "--micro-batch", "2", "--num-workers", "0")


def env() -> dict[str, str]:
    return clean_env(PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plain_run(tmp: Path, *args: str, timeout: float = 300) -> None:
    """train.py as a plain script: no torch.distributed environment, one process."""
    proc = run([sys.executable, str(TRAIN), *args], timeout=timeout, env=env(), cwd=tmp)
    assert proc.returncode == 0, f"train.py failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"


def checkpoint_model(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    """The model parameters of ``run_dir``'s DCP checkpoint of ``step``."""
    target = run_dir / f"model_{step}.pt"
    dcp_to_torch_save(run_dir / "checkpoints" / f"step_{step:09d}", target)
    return torch.load(target, weights_only=False)["model"]


def tiny_logits(state: dict[str, torch.Tensor], config: LlamaConfig) -> torch.Tensor:
    model = Llama(config)
    model.load_state_dict(state, strict=True)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        return model(ids).logits


# --------------------------------------------------------------------------- fixed size


def test_standalone_two_ranks_trains_and_loss_falls(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    cmd = hyperpodrun_cmd(
        "--standalone",
        "--nproc-per-node",
        "2",
        str(TRAIN),
        *SMALL,
        "--steps",
        "12",
        "--log-every",
        "1",
        "--data-cache",
        str(tmp_path / "data"),
        "--run-dir",
        str(tmp_path),
        "--metrics",
        str(metrics),
    )
    proc = run(cmd, timeout=300, env=env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = read_jsonl(metrics)
    assert [r["step"] for r in records] == list(range(1, 13))
    assert {r["world_size"] for r in records} == {2}
    first, last = records[0]["loss"], records[-1]["loss"]
    assert first > 5.0, f"an untrained byte model starts near ln(258) = 5.55, got {first}"
    assert last < first - 1.0, f"loss did not fall: {first:.3f} -> {last:.3f}"
    assert "batch 6 = 2 x [2, 1]" in proc.stdout  # 3 samples per rank as micro-batches of at most 2
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000000012"]


def test_a_step_whose_peer_dies_after_the_optimizer_step_is_logged_once(tmp_path: Path) -> None:
    """kill -9 of rank 1 in a step's idle tail (``--min-step-time``: after the optimizer step, before the loss
    all-reduce for the log): rank 0 has trained the step when its all-reduce fails, and the repaired round
    goes on after it. The sample log has every step once, at the world that trained it, and each step's
    full global batch."""
    samples, events = tmp_path / "samples.jsonl", tmp_path / "events.jsonl"
    cmd = hyperpodrun_cmd(
        *("--nnodes", "1", "--nproc-per-node", "2", "--max-restarts", "3"),
        *("--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-conf", "tick=0.1"),
        *("--event-log", str(events)),
        str(TRAIN),
        *SMALL,
        "--steps",
        "14",
        "--log-every",
        "1",
        "--min-step-time",
        "1.5",  # most of each step is its idle tail: the kill lands 0.8 s into step 5, after its optimizer step
        "--data-cache",
        str(tmp_path / "data"),
        "--run-dir",
        str(tmp_path),
        "--sample-log",
        str(samples),
    )
    launcher = subprocess.Popen(cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(
            lambda: samples.exists() and max((r["step"] for r in read_jsonl(samples)), default=0) >= 4,
            timeout=180,
            what="step 4",
        )
        # step 5's work (its optimizer step included) must end before the kill, 0.8 s in, even on a loaded machine;
        # its loss all-reduce starts at 1.5 s
        wait_until(lambda: time.time() - samples.stat().st_mtime >= 0.8, timeout=30, what="the tail of step 5")
        victim = rank_process(launcher.pid, rank=1)
        victim.kill()
        out, err = launcher.communicate(timeout=240)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 0, err[-4000:]
    log = read_jsonl(events)
    assert [(e["rank"], e["repaired_in_place"]) for e in log if e["event"] == "worker_failed"] == [(1, True)]
    # rank 0 had taken step 5's optimizer step: its all-reduce for the log failed, the repair went on after it
    assert [(e["rank"], e["step"]) for e in log if e["event"] == "peer_failed"] == [(0, 5)]
    records = read_jsonl(samples)
    assert sorted((r["step"], r["rank"]) for r in records if r["rank"] == 0) == [(s, 0) for s in range(1, 15)]
    per_step: dict[int, int] = {}
    for r in records:
        per_step[r["step"]] = per_step.get(r["step"], 0) + len(r["sample_ids"])
    assert per_step == {**dict.fromkeys(range(1, 15), 6), 5: 3}  # rank 1 trained its half of step 5, unlogged
    trained = [i for r in records for i in r["sample_ids"]]
    assert len(trained) == len(set(trained)), "a sample was trained twice"
    assert victim.pid not in {p.pid for p in psutil.Process().children(recursive=True)}


def rank_process(launcher: int, *, rank: int) -> psutil.Process:
    """The launcher's worker process started as ``rank``."""
    for child in psutil.Process(launcher).children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank) and "train.py" in " ".join(child.cmdline()):
                return child
        except psutil.NoSuchProcess:
            continue
    raise AssertionError(f"no rank {rank} under launcher {launcher}")


# ----------------------------------------------------------------------------- elastic


@dataclass(frozen=True)
class ElasticRuns:
    summary: demo.Summary  # of the 1 -> 2 -> 1 hyperpodrun job
    elastic_final: Path
    plain_dir: Path  # the single-process reference run (checkpoints of its last two steps)
    plain_final: Path
    num_samples: int


@pytest.fixture(scope="module")
def elastic_runs(tmp_path_factory: pytest.TempPathFactory) -> ElasticRuns:
    """A 1 -> 2 -> 1 hyperpodrun job and a plain single-process run of the same training."""
    root = tmp_path_factory.mktemp("elastic")
    config = demo.DemoConfig(
        run_dir=root / "elastic",
        steps=ELASTIC_STEPS,
        global_batch=ELASTIC_BATCH,
        micro_batch=2,
        seq_len=64,
        seed=ELASTIC_SEED,
        min_step_time=0.25,
        ckpt_every=1,  # every event lands on a save step: a joiner must not be expected to save it
        schedule=(
            demo.Change(at_step=2, action="join", node="node-2"),
            demo.Change(at_step=20, action="leave", node="node-2"),
        ),
        train_args=("--save-final", str(root / "elastic_final.pt")),
    )
    with open(root / "demo.out", "w") as out:
        summary = demo.run_demo(config, out=out)
    plain_run(
        root,
        "--steps",
        str(ELASTIC_STEPS),
        "--global-batch",
        str(ELASTIC_BATCH),
        "--micro-batch",
        "2",
        "--seq-len",
        "64",
        "--seed",
        str(ELASTIC_SEED),
        "--num-workers",
        "0",
        "--data-cache",
        str(config.data_cache),
        "--run-dir",
        str(root / "plain"),
        "--save-final",
        str(root / "plain_final.pt"),
        "--ckpt-every",
        str(ELASTIC_STEPS - 1),
    )
    dataset = train.TokenDataset(next(config.data_cache.glob("tokens-*")), 64)
    return ElasticRuns(summary, root / "elastic_final.pt", root / "plain", root / "plain_final.pt", len(dataset))


@pytest.mark.slow
def test_elastic_run_reaches_each_world_size(elastic_runs: ElasticRuns) -> None:
    summary = elastic_runs.summary
    assert summary.problems == ()
    assert summary.world_sizes == (1, 2, 1)
    assert summary.exit_codes == {"node-1": 0, "node-2": 0}
    assert [(e.from_world, e.to_world) for e in summary.scale_events] == [(1, 2), (2, 1)]
    for event in summary.scale_events:
        assert event.downtime_s is not None and 0 < event.downtime_s < 120
    # Both scale events in place (the example uses ElasticTraining): nothing loaded for them, the joiner
    # hydrated from its peer. A checkpoint every step, each once, the event's step saved by the world that
    # trained it, before the event (a joiner, hydrated at that step, is not part of that save).
    assert [e.mode for e in summary.scale_events] == ["in place", "in place"]
    events = read_jsonl(summary.run_dir / "events.jsonl")
    saved = {e["step"]: e["world_size"] for e in events if e["event"] == "checkpoint_saved"}
    assert sorted(saved) == list(range(1, ELASTIC_STEPS + 1)) and not [
        e for e in events if e["event"] == "checkpoint_loaded"
    ]
    hydrated = [(e["world_size"], e["newcomers"]) for e in events if e["event"] == "hydrated"]
    assert hydrated == [(2, 1), (1, 0)]
    steps = [e["step"] for e in events if e["event"] == "hydrated"]
    assert 0 < steps[0] < steps[1] < ELASTIC_STEPS
    assert (saved[steps[0]], saved[steps[0] + 1], saved[steps[1]], saved[steps[1] + 1]) == (1, 2, 2, 1)


@pytest.mark.slow
def test_elastic_run_trains_every_sample_exactly_once(elastic_runs: ElasticRuns) -> None:
    records = read_jsonl(elastic_runs.summary.run_dir / "samples.jsonl")
    steps, global_batch = ELASTIC_STEPS, ELASTIC_BATCH
    trained = [i for r in records for i in r["sample_ids"]]
    assert len(trained) == len(set(trained)), "a sample was trained twice"
    first_samples = epoch_permutation(elastic_runs.num_samples, seed=ELASTIC_SEED, epoch=0)[
        : steps * global_batch
    ].tolist()
    assert sorted(trained) == sorted(first_samples), "the samples trained are not the epoch's first ones"
    by_world = {r["world_size"] for r in records}
    assert by_world == {1, 2}, "the sample log must cover both world sizes"
    per_step = {}
    for r in records:
        per_step[r["step"]] = per_step.get(r["step"], 0) + len(r["sample_ids"])
    assert per_step == {s: global_batch for s in range(1, steps + 1)}, "the global batch changed with the world size"


@pytest.mark.slow
def test_elastic_run_ends_with_the_parameters_of_a_fixed_size_run(elastic_runs: ElasticRuns) -> None:
    elastic, plain = torch.load(elastic_runs.elastic_final), torch.load(elastic_runs.plain_final)
    assert sorted(elastic) == sorted(plain)
    worst = max((elastic[k] - plain[k]).abs().max().item() for k in plain)
    print(f"largest parameter difference elastic vs plain: {worst:.3e}")
    for name in plain:
        torch.testing.assert_close(elastic[name], plain[name], rtol=0, atol=ELASTIC_ATOL, msg=f"parameter {name}")
    before_last = checkpoint_model(elastic_runs.plain_dir, ELASTIC_STEPS - 1)
    last_update = max((plain[k] - before_last[k]).abs().max().item() for k in plain)
    assert last_update > 10 * ELASTIC_ATOL, (
        f"the last step moved parameters by only {last_update:.2e}: the tolerance proves nothing"
    )


def trained_by_one_process(tmp_path: Path, *args: str) -> dict:
    """The final parameters (``--save-final``) of the example run with ``args`` by one plain process."""
    plain_run(tmp_path, *args, "--run-dir", str(tmp_path / "plain"), "--save-final", str(tmp_path / "plain.pt"))
    return torch.load(tmp_path / "plain.pt")


def trained_by_one_and_two_ranks(
    tmp_path: Path, *args: str, fsdp: bool, nproc: int = 2, parallel: tuple[str, ...] = ()
) -> tuple[dict, dict]:
    """The final parameters (``--save-final``) of the example run with ``args`` by one plain process, and by
    ``nproc`` ranks under hyperpodrun (DDP, FSDP2 with ``fsdp``, or the ``parallel`` flags)."""
    return trained_by_one_process(tmp_path, *args), trained_by_ranks(
        tmp_path, *args, fsdp=fsdp, nproc=nproc, parallel=parallel
    )


def trained_by_ranks(tmp_path: Path, *args: str, fsdp: bool, nproc: int = 2, parallel: tuple[str, ...] = ()) -> dict:
    """The final parameters of the example run with ``args`` by ``nproc`` ranks under hyperpodrun (DDP, FSDP2
    with ``fsdp``, or the ``parallel`` flags)."""
    cmd = hyperpodrun_cmd(
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        str(TRAIN),
        *args,
        *(("--fsdp",) if fsdp else parallel),
        "--run-dir",
        str(tmp_path / "two"),
        "--save-final",
        str(tmp_path / "two.pt"),
    )
    proc = run(cmd, timeout=300, env=env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(tmp_path / "two.pt")


def test_fsdp_training_matches_a_single_process(tmp_path: Path) -> None:
    """FSDP2 over 2 ranks (uneven micro-batches [2, 1], gradient sync on the last one only,
    averaged reduce-scatter, clipping of sharded gradients) trains what one process trains."""
    args = (*SMALL, "--steps", "6", "--seed", "4", "--data-cache", str(tmp_path / "data"))
    plain, fsdp = trained_by_one_and_two_ranks(tmp_path, *args, fsdp=True)
    initial = Llama(LlamaConfig.from_name("tiny"))
    initial.init_weights(seed=4)
    for name, value in initial.state_dict().items():
        assert (plain[name] - value).abs().max() > 100 * ELASTIC_ATOL, f"{name} barely trained"
        torch.testing.assert_close(fsdp[name], plain[name], rtol=0, atol=ELASTIC_ATOL, msg=f"parameter {name}")


@pytest.fixture(scope="module")
def fp64_plain(tmp_path_factory: pytest.TempPathFactory) -> tuple[tuple[str, ...], dict]:
    """The fp64 runs' arguments (their data cache shared) and the parameters one plain process trains with them."""
    tmp = tmp_path_factory.mktemp("fp64")
    args = (*SMALL, "--steps", "6", "--seed", "4", "--data-cache", str(tmp / "data"), "--dtype", "fp64")
    return args, trained_by_one_process(tmp, *args)


@pytest.mark.parametrize("parallel", ["ddp", "fsdp", "hsdp"])
def test_fp64_runs_at_two_world_sizes_agree_to_float64_precision(
    tmp_path: Path, parallel: str, fp64_plain: tuple[tuple[str, ...], dict]
) -> None:
    """--dtype fp64: weights, optimizer state and every reduction in float64, so the summation order of
    another world size moves parameters by ~1e-15, not fp32's ~1e-6: what the soak's check relies on.
    hsdp: 4 ranks in shard groups of 2 (a 2 x 2 mesh: reduce-scatter in each replica, all-reduce across them)."""
    args, plain = fp64_plain
    hsdp = ("--hsdp", "--hsdp-shard-size", "2") if parallel == "hsdp" else ()
    two = trained_by_ranks(tmp_path, *args, fsdp=parallel == "fsdp", nproc=4 if hsdp else 2, parallel=hsdp)
    assert {v.dtype for v in plain.values()} == {v.dtype for v in two.values()} == {torch.float64}
    initial = Llama(LlamaConfig.from_name("tiny")).to(torch.float64)
    initial.init_weights(seed=4)
    for name, value in initial.state_dict().items():
        assert (plain[name] - value).abs().max() > 1e-4, f"{name} barely trained"
        torch.testing.assert_close(two[name], plain[name], rtol=0, atol=1e-12, msg=f"parameter {name}")


def test_hsdp_on_a_world_that_is_not_whole_replicas_is_one_line_and_exit_2(tmp_path: Path) -> None:
    cmd = hyperpodrun_cmd(
        *("--standalone", "--nproc-per-node", "2", str(TRAIN), *SMALL, "--steps", "1"),
        *("--hsdp", "--hsdp-shard-size", "3", "--data-cache", str(tmp_path / "data"), "--run-dir", str(tmp_path)),
    )
    proc = run(cmd, timeout=300, env=env())
    assert proc.returncode != 0
    assert "train.py: error: HSDP shard size 3 does not divide the world of 2 ranks" in proc.stderr, proc.stderr[-3000:]


def test_deterministic_reduce_trains_the_bits_of_one_process_on_two_ranks(tmp_path: Path) -> None:
    """--deterministic-reduce (fp32): each sample's gradient alone, summed along a tree fixed by batch positions,
    so 2 ranks with uneven shares ([2, 1] each) end with exactly one process's parameters: the soak's check."""
    args = (
        *SMALL,
        "--steps",
        "6",
        "--seed",
        "4",
        "--data-cache",
        str(tmp_path / "data"),
        "--dtype",
        "fp32",
        "--deterministic-reduce",
    )
    plain, two = trained_by_one_and_two_ranks(tmp_path, *args, fsdp=False)
    initial = Llama(LlamaConfig.from_name("tiny"))
    initial.init_weights(seed=4)
    for name, value in initial.state_dict().items():
        assert (plain[name] - value).abs().max() > 1e-3, f"{name} barely trained"
        assert torch.equal(two[name], plain[name]), f"parameter {name}: {(two[name] - plain[name]).abs().max()}"


# --------------------------------------------------------------------------- init-from


@pytest.mark.parametrize("parallelism", ["single-process", "ddp-2-ranks", "fsdp-2-ranks"])
def test_init_from_loads_hugging_face_weights(tmp_path: Path, parallelism: str) -> None:
    """Rank 0 reads the safetensors and broadcasts them (DDP replicas, FSDP2 shards); the
    gathered final parameters reproduce the saved model's logits exactly."""
    config = LlamaConfig.from_name("tiny")
    source = Llama(config)
    source.init_weights(seed=123)
    save_hf_llama(source, config, tmp_path / "hf")
    final = tmp_path / "final.pt"
    args = (
        "--init-from",
        str(tmp_path / "hf"),
        "--steps",
        "0",
        "--save-final",
        str(final),
        "--data-cache",
        str(tmp_path / "data"),
        "--run-dir",
        str(tmp_path),
        *SMALL,
    )
    if parallelism == "single-process":
        plain_run(tmp_path, *args)
    else:
        fsdp = ("--fsdp",) if parallelism == "fsdp-2-ranks" else ()
        cmd = hyperpodrun_cmd("--standalone", "--nproc-per-node", "2", str(TRAIN), *args, *fsdp)
        proc = run(cmd, timeout=300, env=env())
        assert proc.returncode == 0, proc.stderr[-4000:]
        assert ("FSDP2" if fsdp else "DDP") in proc.stdout
    loaded = torch.load(final)
    expected = tiny_logits(source.state_dict(), config)
    torch.testing.assert_close(tiny_logits(loaded, config), expected, rtol=0, atol=0)
    own_init = Llama(config)
    own_init.init_weights(seed=0)  # what train.py would have trained without --init-from
    assert not torch.allclose(tiny_logits(own_init.state_dict(), config), expected), "seeds 0 and 123 must differ"


# ------------------------------------------------------------------------------ config


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--global-batch", "0"], "--global-batch"),
        (["--lr", "-1"], "--lr"),
        (["--min-lr-ratio", "2"], "--min-lr-ratio"),
        (["--model", "tiny", "--init-from", "."], "--model and --init-from"),
        (["--data", "/nonexistent/corpus.jsonl"], "--data /nonexistent/corpus.jsonl"),
        (["--deterministic-reduce", "--fsdp"], "--deterministic-reduce needs DDP or one process"),
        (["--deterministic-reduce", "--hsdp"], "--deterministic-reduce needs DDP or one process"),
        (["--fsdp", "--hsdp"], "--fsdp and --hsdp exclude each other"),
        (["--hsdp-shard-size", "2"], "--hsdp-shard-size needs --hsdp"),
        (["--hsdp", "--hsdp-shard-size", "0"], "--hsdp-shard-size must be an integer >= 1"),
    ],
)
def test_invalid_flags_name_the_flag(argv: list[str], flag: str) -> None:
    with pytest.raises(train.ConfigError, match=flag):
        train.parse_args(argv)


def test_unknown_preset_is_a_one_line_error(tmp_path: Path, monkeypatch, capsys) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)  # a plain process: no process group to join
    assert train.main(["--model", "llama9-1t", "--data-cache", str(tmp_path)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("train.py: error: --model: name: unknown preset 'llama9-1t'"), lines


def test_scale_config_overrides_micro_batch_and_workers_per_world_size(tmp_path: Path) -> None:
    path = tmp_path / "scale.yaml"
    path.write_text("default: {num_workers: 1}\n2: {micro_batch: 3}\n4: {micro_batch: 1, num_workers: 0}\n")
    cfg = train.TrainConfig(micro_batch=4, num_workers=2, scale_config=path)
    resolved = {w: train.resolve_overrides(cfg, w) for w in (1, 3, 8)}
    assert [(c.micro_batch, c.num_workers) for c in resolved.values()] == [(4, 1), (3, 1), (1, 0)]
    assert resolved[3].global_batch == cfg.global_batch and resolved[3].lr == cfg.lr  # never scaled
    path.write_text("2: {lr: 0.1}\n")
    with pytest.raises(train.ScaleConfigError, match="world size 2: unknown key 'lr'"):
        train.resolve_overrides(cfg, 2)


def test_tokenizer_json_without_the_tokenizers_package_is_a_clear_error(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    (tmp_path / "tokenizer.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import tokenizers -> ImportError
    with pytest.raises(train.TrainError, match="needs the 'tokenizers' package: pip install tokenizers"):
        train.load_tokenizer(tmp_path)
    assert isinstance(train.load_tokenizer(None), train.ByteTokenizer)


def test_describe_plan_groups_ranks_with_equal_micro_batches() -> None:
    from elastic_events.data.batching import plan_global_batch

    assert train.describe_plan(plan_global_batch(global_batch=8, micro_batch=4, world_size=1)) == "8 = 1 x [4, 4]"
    assert (
        train.describe_plan(plan_global_batch(global_batch=8, micro_batch=2, world_size=3))
        == "8 = 2 x [2, 1] + 1 x [2]"
    )
