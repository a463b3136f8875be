"""The arithmetic of an elastic evaluation pass (``lightning_elan/accelerate/evaluation.py``): every process's batches,
the padding a gather drops, and what is left after a member dies mid-pass — without processes."""

from __future__ import annotations

from collections import Counter

from lightning_elan.accelerate.evaluation import EvaluationPass, EvaluationPlan, Progress, same_place

SAMPLES = tuple(range(30))


def passes(world: int, batch_size: int = 4) -> list[EvaluationPass]:
    return [EvaluationPass(SAMPLES, world, rank, batch_size) for rank in range(world)]


def take(members: list[EvaluationPass], held: dict[int, list[int]]) -> bool:
    """Each member takes its next batch (``held``: what it loaded, by member); False when the pass is over."""
    for member in members:
        indices = member.next_batch()
        if indices is None:
            return False
        held[id(member)] = indices
    return True


def gathered(members: list[EvaluationPass], held: dict[int, list[int]]) -> list[int]:
    """What a gather of the members' sample ids keeps: the batches they hold, in rank order, without the padding."""
    rows = [sample for member in members for sample in held[id(member)]]
    kept = members[0].kept_rows()
    return rows if kept is None else [rows[row] for row in kept[1]]


def test_the_first_plan_shards_as_accelerate_and_pads_the_last_batch() -> None:
    plan = EvaluationPlan(SAMPLES, 2, 4)
    assert len(plan) == 4
    assert plan.indices(0, 1) == [4, 5, 6, 7]
    assert plan.indices(3, 0) == [24, 25, 26, 27]
    assert plan.indices(3, 1) == [28, 29, 0, 1]
    assert EvaluationPlan(SAMPLES, 1, 4).indices(7, 0) == [28, 29]  # a single process is not padded


def test_a_static_pass_gathers_every_sample_once() -> None:
    members, seen, held = passes(3), [], {}
    while take(members, held):
        seen += gathered(members, held)
    assert seen == list(SAMPLES)


def test_after_a_death_the_survivors_gather_the_rest_once() -> None:
    """3 processes, rank 1 dies in batch 1's collective: the survivors gather their parts of it, then a plan for 2
    processes of rank 1's part and the batches after it."""
    members, seen, held = passes(3), [], {}
    for _ in range(2):
        assert take(members, held)
        if members[0].batch == 0:
            seen += gathered(members, held)
    survivors = [members[0], members[2]]
    places = [member.progress() for member in survivors]
    assert same_place(places) and places[0] == Progress(0, 0, 1, 0)
    for new_rank, member in enumerate(survivors):
        assert member.recovered(places, new_rank, 2) == []
    seen += gathered(survivors, held)  # the collective again, among the survivors
    while take(survivors, held):
        seen += gathered(survivors, held)
    assert sorted(seen) == list(SAMPLES) and Counter(seen).most_common(1)[0][1] == 1


def test_a_second_death_before_the_next_batch_and_a_death_between_two_collectives() -> None:
    members = passes(3)
    for member in members:
        member.next_batch()
        member.collective_done()  # the batch's first collective gathered every part
    places = [members[0].progress(), members[1].progress()]
    twice = [member.recovered(places, rank, 2) for rank, member in enumerate(members[:2])]
    assert twice == [[8, 9, 10, 11]] * 2  # rank 2's part: in the first collective, evaluated again
    places = [members[1].progress()]  # rank 0 dies too, in the same batch's next collective
    assert members[1].recovered(places, 0, 1) == [0, 1, 2, 3]
    assert members[1].kept_rows() is None  # the survivor's own part: no padding
    batches = []
    while (indices := members[1].next_batch()) is not None:
        batches += indices
    assert batches == [0, 1, 2, 3, 8, 9, 10, 11, *range(12, 30)]
