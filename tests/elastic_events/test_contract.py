"""The launcher-rank contract: a rank's environment read once and checked, and torchrun's variables
written from one place for both sides."""

from __future__ import annotations

import pytest

from elastic_events.contract import (
    CONTROL_FILE_ENV,
    PARKED_ENV,
    RESTART_REASON_ENV,
    ROUND_ENV,
    ROUND_VARIABLES,
    SNAPSHOT_EVERY_ENV,
    ContractError,
    GroupAssignment,
    RankContext,
    RestartReason,
    rank_environment,
)

A = GroupAssignment(group_rank=2, group_world_size=3, nproc_per_node=4, master_addr="10.0.0.1", master_port=29500)


def test_ranks_are_contiguous_per_node() -> None:
    assert A.world_size == 12
    assert [A.global_rank(r) for r in range(4)] == [8, 9, 10, 11]
    with pytest.raises(ContractError, match="local rank 4 is outside this node's 4 ranks"):
        A.global_rank(4)


def test_a_rank_environment_is_torchruns_round_variables_and_the_round() -> None:
    env = rank_environment(A, 1, round=7)
    assert set(env) == {*ROUND_VARIABLES, ROUND_ENV}
    assert env == {
        "RANK": "9",
        "GROUP_RANK": "2",
        "ROLE_RANK": "9",
        "WORLD_SIZE": "12",
        "GROUP_WORLD_SIZE": "3",
        "ROLE_WORLD_SIZE": "12",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500",
        ROUND_ENV: "7",
    }


def test_what_a_launcher_sets_is_read_back_exactly() -> None:
    env = {
        **rank_environment(A, 3, round=5),
        "LOCAL_RANK": "3",
        "LOCAL_WORLD_SIZE": "4",
        CONTROL_FILE_ENV: "/dev/shm/x/control",
        RESTART_REASON_ENV: "failure",
        SNAPSHOT_EVERY_ENV: "5",
        "TORCHELASTIC_RUN_ID": "job",
    }
    ctx = RankContext.from_env(env)
    assert (ctx.rank, ctx.world_size, ctx.local_rank, ctx.local_world_size) == (11, 12, 3, 4)
    assert (ctx.round, ctx.group_rank, ctx.group_world_size) == (5, 2, 3)
    assert ctx.launched and not ctx.parked and ctx.under_hyperpodrun
    assert ctx.restart_reason is RestartReason.FAILURE and ctx.snapshot_every == 5 and ctx.run_id == "job"
    assert ctx.assignment == A


def test_a_plain_script_is_rank_0_of_1() -> None:
    ctx = RankContext.from_env({})
    assert (ctx.rank, ctx.world_size, ctx.launched, ctx.under_hyperpodrun) == (0, 1, False, False)
    assert ctx.snapshot_every is None and ctx.restart_reason is RestartReason.START


def test_a_parked_rank_has_no_round_until_admitted() -> None:
    env = {PARKED_ENV: "1", CONTROL_FILE_ENV: "/dev/shm/c", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "RANK": "5"}
    ctx = RankContext.from_env(env)
    assert ctx.parked and not ctx.launched and (ctx.rank, ctx.world_size) == (0, 1)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"RANK": "0"}, "RANK is set but WORLD_SIZE is not"),
        ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x': expected an integer"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK 2 is outside WORLD_SIZE 2"),
        ({"LOCAL_RANK": "1"}, "LOCAL_RANK 1 is outside LOCAL_WORLD_SIZE 1"),
        ({"LOCAL_WORLD_SIZE": "0"}, "LOCAL_WORLD_SIZE='0': expected an integer >= 1"),
        ({PARKED_ENV: "1"}, "HYPERPODRUN_PARKED=1 needs the control channel"),
        ({RESTART_REASON_ENV: "reboot"}, "HYPERPODRUN_RESTART_REASON='reboot': expected one of start, scale, failure"),
        ({SNAPSHOT_EVERY_ENV: "-1"}, "HYPERPODRUN_SNAPSHOT_EVERY='-1': expected 'auto' or an integer >= 0"),
        ({SNAPSHOT_EVERY_ENV: "often"}, "HYPERPODRUN_SNAPSHOT_EVERY='often': expected 'auto' or an integer >= 0"),
    ],
)
def test_an_environment_no_launcher_would_give_is_refused_with_its_variable(env: dict, message: str) -> None:
    with pytest.raises(ContractError, match=message.replace("(", r"\(").replace(")", r"\)")):
        RankContext.from_env(env)
