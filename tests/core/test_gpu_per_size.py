"""A service's memory per GPU and restore time may differ per chunk size (tensor parallel)."""
from __future__ import annotations

from sched_util import call_spec
from test_scheduler import make, started

from tangram.core import commands as cmd
from tangram.core import events as ev


def _define(s, name):
    # 60 GB on one GPU; a 4-GPU copy holds 15 GB per GPU and restores 4x faster
    s.handle(ev.ServiceDefined(name, 60_000, (1, 4), load_s=1.2, t_ori=2.0,
                               per_size=((4, 15_000, 0.3),)), 0)


def test_four_gpu_copies_of_four_services_share_the_same_gpus():
    s = make(cores=1, gpus=4, gpu_mem=80_000)
    for name in ("a", "b", "c", "d"):
        _define(s, name)
    t = 0.0
    for name in ("a", "b", "c", "d"):
        out = s.handle(ev.ActionSubmitted(call_spec(f"{name}1", name, (4,))), t)
        assert [type(c) for c in out] == [cmd.Load, cmd.Invoke]  # no eviction: 4 x 15 GB fit
        assert out[0].est_s == 0.3
        s.handle(ev.ActionFinished(f"{name}1"), t + 1.0)
        t += 2.0
    for name in ("a", "b", "c", "d"):  # all four stayed resident
        out = s.handle(ev.ActionSubmitted(call_spec(f"{name}2", name, (4,))), t)
        assert [type(c) for c in out] == [cmd.Invoke]
        s.handle(ev.ActionFinished(f"{name}2"), t + 1.0)
        t += 2.0


def test_sizes_without_an_override_keep_the_service_default():
    s = make(cores=1, gpus=4, gpu_mem=80_000)
    _define(s, "a")
    _define(s, "b")
    out = s.handle(ev.ActionSubmitted(call_spec("a1", "a", (1,))), 0.0)
    assert [type(c) for c in out] == [cmd.Load, cmd.Invoke]
    assert out[0].est_s == 1.2
    s.handle(ev.ActionFinished("a1"), 1.0)
    # a one-GPU copy of b does not fit next to a's 60 GB on GPU 0: it takes another GPU
    (inv,) = started(s.handle(ev.ActionSubmitted(call_spec("b1", "b", (1,))), 2.0), cmd.Invoke)
    assert inv.start != 0
