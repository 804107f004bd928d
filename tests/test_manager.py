"""Running a declared pass list (``sdnpu.passes.manager``): groups and their records' names, the fixpoint loops
(a ``Group`` with rounds: until a round in which its ``until`` step changed nothing, at most its bound), what
``pass_names`` lists, the per-pass hook, and the error that names the failing step."""

from __future__ import annotations

import onnx_ir as ir
import pytest

from sdnpu.passes.manager import Group, PassResult, pass_list_names, run_passes
from sdnpu.passes.pipeline import CANONICAL, CompileOptions, pass_names


def _model() -> ir.Model:
    return ir.Model(ir.Graph([], [], nodes=[], opset_imports={"": 20}), ir_version=10)


def counting(changes: int):
    """A step that reports a change on its first ``changes`` calls, and none after."""
    calls = [0]

    def step(model: ir.Model) -> PassResult:
        calls[0] += 1
        return PassResult(modified=calls[0] <= changes, counts={"changes": int(calls[0] <= changes)})

    return step


def idle(model: ir.Model) -> PassResult:
    return PassResult(modified=False)


def busy(model: ir.Model) -> PassResult:
    return PassResult(modified=True, counts={"always": 1})


def test_a_group_names_its_steps_and_a_loop_its_rounds():
    passes = [("a", idle), Group("g", [("b", idle), Group("loop", [("c", busy), ("d", counting(2))],
                                                          rounds=5, until="d")]), ("e", idle)]
    assert list(pass_list_names(passes)) == ["a", "g/b", "g/loop[<=5]/c", "g/loop[<=5]/d", "e"]
    seen: list[str] = []
    records = run_passes(_model(), passes, after_each=lambda name, m: seen.append(name))
    # d changes twice: a third round finds it changes nothing and ends the loop (c changing every time does not
    # keep it going: the loop asks d)
    assert [r.name for r in records] == seen == ["a", "g/b", "g/loop[1]/c", "g/loop[1]/d", "g/loop[2]/c",
                                                 "g/loop[2]/d", "g/loop[3]/c", "g/loop[3]/d", "e"]


def test_a_loop_until_several_steps_goes_on_while_any_of_them_changes():
    """``until`` naming several steps: a round in which none of them changed anything ends the loop (the tables'
    rounds: sinking unary ops and computing repeats once, either of which can give the other work)."""
    passes = [Group("loop", [("a", counting(1)), ("b", counting(3)), ("c", busy)], rounds=6, until=("a", "b"))]
    assert list(pass_list_names(passes)) == ["loop[<=6]/a", "loop[<=6]/b", "loop[<=6]/c"]
    records = run_passes(_model(), passes)
    # a changes in round 1, b in rounds 1-3; round 4 changes neither (c always changes: it is not asked)
    assert [r.name for r in records if r.name.endswith("/a")] == [f"loop[{i}]/a" for i in range(1, 5)]


def test_a_loop_stops_at_its_bound():
    records = run_passes(_model(), [Group("loop", [("x", busy)], rounds=3, until="x")])
    assert [r.name for r in records] == ["loop[1]/x", "loop[2]/x", "loop[3]/x"]


@pytest.mark.parametrize(("rounds", "until", "message"), [(3, "nothing", "names 'nothing', none of its steps"),
                                                          (3, ("x", "y"), "names 'y', none of its steps"),
                                                          (3, (), "names nothing, none of its steps"),
                                                          (0, "", "at least 1")])
def test_a_loop_must_say_when_it_ends(rounds, until, message):
    with pytest.raises(ValueError, match=message):
        Group("loop", [("x", idle)], rounds=rounds, until=until)


def test_a_failing_step_is_named_with_the_passes_before_it():
    def fails(model: ir.Model) -> PassResult:
        raise KeyError("boom")

    with pytest.raises(RuntimeError, match=r"pass 'g/two' failed \(after: first, g \(its last step: g/one\)\): "
                                           r"KeyError"):
        run_passes(_model(), [("first", idle), Group("g", [("one", idle), ("two", fails)])])


def test_pass_names_lists_every_canonical_step_and_its_loops():
    names = pass_names(CompileOptions())
    canonical = [x for x in names if x.startswith("canonical/")]
    assert names[:len(canonical)] == canonical == list(pass_list_names([CANONICAL]))
    assert canonical[0] == "canonical/opset" and canonical[-1] == "canonical/finish"
    assert "canonical/fold_rounds[<=10]/fold_small" in canonical and "canonical/crop_rounds[<=8]/crop" in canonical
    assert "canonical/tables/rounds[<=16]/sink_unary" in canonical
    assert pass_names(CompileOptions(), steps=False)[:2] == ["canonical", "joint"]
