"""The AM's one-line event messages (``master/narration.py``): what a user reads in the default log."""

from __future__ import annotations

from lightning_elan.master.narration import completed_line, decided_line, plural, workers_phrase

PLAN = {"request_id": "r1", "action": "add", "generation": 1, "previous_generation": 0, "step": 10,
        "members": ["w0", "w1", "w2"], "previous_members": ["w0", "w1"], "joiners": ["w2"], "leavers": [],
        "sources": {"w2": "w0"}}
RECORD = {"job": "pd", "action": "add", "step": 10, "generation": 1, "members": ["w0", "w1", "w2"],
          "joiners": ["w2"], "leavers": [], "bytes_replicated": 5294247, "pause_s": {"w0": 0.0597, "w1": 0.056},
          "joiner_startup_s": {"w2": 8.57}, "received": {"w2": {"source": "w0", "route": "shm"}}}


def test_plural_and_lists():
    assert [plural(1, "worker"), plural(2, "worker"), plural(0, "worker")] == ["1 worker", "2 workers", "0 workers"]
    assert [workers_phrase([]), workers_phrase(["w1"]), workers_phrase(["w1", "w2"]),
            workers_phrase(["w1", "w2", "w3"])] == ["", "w1", "w1 and w2", "w1, w2 and w3"]


def test_a_decided_plan_is_one_short_line():
    line = decided_line("pd", PLAN)
    assert line == "job 'pd' grows after step 10: w2 joins; 2 → 3 workers, generation 0 → 1"
    migrate = {**PLAN, "action": "migrate", "joiners": ["w3"], "leavers": ["w1"], "members": ["w0", "w3"]}
    assert decided_line("pd", migrate) == ("job 'pd' migrates after step 10: w3 joins; w1 leaves; 2 → 2 workers, "
                                           "generation 0 → 1")
    shrink = {**PLAN, "action": "remove", "joiners": [], "leavers": ["w0"], "members": ["w1"]}
    assert "w0 leaves; 2 → 1 worker," in decided_line("pd", shrink)


def test_a_completed_adjustment_says_its_pause_and_copy():
    assert completed_line("pd", RECORD) == ("job 'pd': generation 1 trains with 3 workers, paused 0.06 s, 5.3 MB "
                                            "copied over shm (joiners ready after 8.6 s)")
    shrink = {**RECORD, "joiners": [], "members": ["w1"], "bytes_replicated": 0, "joiner_startup_s": {},
              "received": {}, "pause_s": {"w1": 0.02}}
    assert completed_line("pd", shrink) == "job 'pd': generation 1 trains with 1 worker, paused 0.02 s"


def test_a_recovery_names_the_dead_and_the_step_redone():
    record = {**RECORD, "action": "failure", "members": ["w0", "w2"],
              "failure": {"dead": ["w1"], "detected_at": 100.0, "recovered_at": 100.35, "step_redone": 11}}
    assert completed_line("pd", record) == ("job 'pd': generation 1 trains with 2 workers after the death of w1 "
                                            "(step 11 redone), recovered in 0.35 s")


def test_a_recovery_outside_the_training_loop_redoes_no_step():
    record = {**RECORD, "action": "failure", "members": ["w0"],
              "failure": {"dead": ["w1"], "detected_at": 100.0, "recovered_at": 100.05, "step_redone": 25,
                          "outside_training": True}}
    assert completed_line("pd", record) == ("job 'pd': generation 1 trains with 1 worker after the death of w1 "
                                            "(outside the training loop: no step redone), recovered in 0.05 s")


def test_missing_fields_never_raise():
    assert decided_line("j", {}) == "job 'j' adjusts after step None: 0 workers, generation None → None"
    assert completed_line("j", {}) == "job 'j': generation None trains with 0 workers"
