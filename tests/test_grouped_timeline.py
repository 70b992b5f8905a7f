"""The grouped timeline kernel against an obvious loop and against the general kernel."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distir_jax.grouped_timeline import pack_ops, padding_ops, run_grouped, start_grouped, step_times
from distir_jax.kernel import OpCosts, Timeline, run_ops, start_timeline

R, S = 6, 4  # resources and finish slots of the test programs


def _random_template(rng, num_ops: int, columns: int) -> dict:
    """Ops on one or two resources, some with a dependency and an output slot."""
    first = rng.integers(0, R, num_ops)
    second = np.where(rng.random(num_ops) < 0.4, rng.integers(0, R, num_ops), -1)
    return dict(
        resource=np.stack([first, second], 1),
        dep_slot=np.where(rng.random(num_ops) < 0.3, rng.integers(0, S, num_ops), -1),
        out_slot=np.where(rng.random(num_ops) < 0.5, rng.integers(0, S, num_ops), -1),
        seconds_column=rng.integers(0, columns, num_ops),
    )


def _loop(template: dict, seconds: np.ndarray) -> tuple[float, np.ndarray]:
    """The obvious simulation of one row: step time and finish slots."""
    clock, slot = np.zeros(R), np.zeros(S)
    for (a, b), dep, out, column in zip(
        template["resource"],
        template["dep_slot"],
        template["out_slot"],
        template["seconds_column"],
        strict=True,
    ):
        start = max(clock[a], clock[b] if b >= 0 else 0.0, slot[dep] if dep >= 0 else 0.0, 0.0)
        end = start + seconds[column]
        clock[a] = end
        if b >= 0:
            clock[b] = end
        if out >= 0:
            slot[out] = end
    return clock.max(), slot


def _grouped(templates, seconds, chunk: int):
    """Every group's templates run ``chunk`` ops per call; ``seconds`` is ``[G, U, Bg]``."""
    g, columns, _ = seconds.shape
    length = -(-max(len(t["dep_slot"]) for t in templates) // chunk) * chunk
    packed = []
    for t in templates:
        ops = pack_ops(t["resource"], t["dep_slot"], t["out_slot"], t["seconds_column"], R, S)
        packed.append(np.concatenate([ops, padding_ops(length - len(ops), R, S, columns - 1)]))
    packed = np.stack(packed)  # [G, length, 5]
    state = start_grouped(g, R, S, seconds.shape[2], jnp.float32)
    for j in range(0, length, chunk):
        state = jax.jit(run_grouped)(state, packed[:, j : j + chunk], seconds)
    return np.asarray(step_times(state, R)), np.asarray(state.finish_slots(R)[:, :S])


@pytest.mark.parametrize("seed", range(4))
def test_groups_match_an_obvious_loop_row_by_row(seed):
    rng = np.random.default_rng(seed)
    groups, rows, columns = 3, 5, 7
    templates = [_random_template(rng, int(rng.integers(1, 40)), columns - 1) for _ in range(groups)]
    seconds = rng.random((groups, columns, rows)).astype(np.float32)
    seconds[:, -1] = 0.0  # the padding column
    times, slots = _grouped(templates, seconds, chunk=8)
    for g, template in enumerate(templates):
        for row in range(rows):
            want_time, want_slots = _loop(template, seconds[g, :, row])
            np.testing.assert_allclose(times[g, row], want_time, rtol=1e-6)
            np.testing.assert_allclose(slots[g, :, row], want_slots, rtol=1e-6)


def test_slices_and_padding_do_not_change_results():
    rng = np.random.default_rng(7)
    templates = [_random_template(rng, 37, 4), _random_template(rng, 5, 4)]
    seconds = rng.random((2, 5, 3)).astype(np.float32)
    seconds[:, -1] = 0.0
    one_call = _grouped(templates, seconds, chunk=40)
    sliced = _grouped(templates, seconds, chunk=3)
    for a, b in zip(one_call, sliced, strict=True):
        np.testing.assert_array_equal(a, b)


def test_agrees_with_the_general_kernel():
    """The same rows through distir_jax.kernel.run_ops (per-configuration structure, precomputed costs)."""
    rng = np.random.default_rng(11)
    template = _random_template(rng, 50, 6)
    rows = 4
    seconds = rng.random((1, 7, rows)).astype(np.float32)
    times, slots = _grouped([template], seconds, chunk=16)
    op_seconds = seconds[0, template["seconds_column"]]  # [N, B]
    n = len(template["dep_slot"])
    program = types.SimpleNamespace(  # run_ops reads only these with precomputed costs
        resource=jnp.asarray(np.broadcast_to(template["resource"], (rows, n, 2))),
        dep_slot=jnp.asarray(np.broadcast_to(template["dep_slot"][:, None], (rows, n, 1))),
        out_slot=jnp.asarray(np.broadcast_to(template["out_slot"], (rows, n))),
        resource_device=jnp.zeros(R, jnp.int32),
    )
    state = start_timeline(R, S, rows)
    state = Timeline(state.clock.astype(jnp.float32), state.finish.astype(jnp.float32), state.busy, None)
    final, _ = run_ops(
        state, program, None, precomputed=OpCosts(jnp.asarray(op_seconds), jnp.asarray(op_seconds))
    )
    np.testing.assert_allclose(times[0], np.asarray(final.clock).max(axis=0), rtol=1e-6)
    np.testing.assert_allclose(slots[0], np.asarray(final.finish), rtol=1e-6)


def test_pack_ops_rejects_ops_without_a_first_resource_or_past_the_slots():
    ok = dict(dep_slot=np.array([-1]), out_slot=np.array([0]), seconds_column=np.array([0]))
    with pytest.raises(ValueError, match="first resource"):
        pack_ops(np.array([[-1, 2]]), **ok, num_resources=R, num_slots=S)
    with pytest.raises(ValueError, match=f"resources up to {R}"):
        pack_ops(np.array([[0, R]]), **ok, num_resources=R, num_slots=S)
    with pytest.raises(ValueError, match="out_slot 4 is past"):
        pack_ops(np.array([[0, -1]]), np.array([-1]), np.array([S]), np.array([0]), R, S)


def test_pack_ops_writes_into_a_given_buffer():
    resource, column = np.array([[0, -1], [1, 2]]), np.array([3, 1])
    dep, out = np.array([-1, 0]), np.array([0, -1])
    buffer = np.full((3, 5), 99, np.int32)
    pack_ops(resource, dep, out, column, R, S, out=buffer[:2])
    np.testing.assert_array_equal(buffer[:2], pack_ops(resource, dep, out, column, R, S))
    slot = R + 1  # the finish slots' first index in the timeline
    np.testing.assert_array_equal(buffer[:2], [[slot + S, 0, 0, slot, 3], [slot, 1, 2, slot + S + 1, 1]])
    assert np.all(buffer[2] == 99)
