"""``train.host_memory``: ``retain`` keeps freed large blocks in the process (the next
step's activations reuse pages already faulted in); ``system`` gives them back."""

from __future__ import annotations

import subprocess
import sys

import pytest

from recscale.config import load_config
from recscale.config.errors import ConfigError
from recscale.train.host_memory import _glibc

# A child process per mode: rounds of a 96 MiB tensor made, written and dropped (what a
# step does with its activations); prints the median page faults of a round after two
# warm-up rounds (the median: now and then the kernel takes a retained block's pages back).
CHILD = """
import resource, sys, torch
from recscale.train.host_memory import set_host_memory
torch.set_num_threads(1)  # no worker threads (their stacks and arenas) appearing mid-count
print(set_host_memory(sys.argv[1]))
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(2):
    t = torch.empty(24 << 20).fill_(1.0); del t
rounds = []
for _ in range(7):
    before = faults()
    t = torch.empty(24 << 20).fill_(1.0); del t
    rounds.append(faults() - before)
print(sorted(rounds)[3])
"""


@pytest.mark.skipif(_glibc() is None, reason="malloc tuning is glibc's")
def test_retain_reuses_freed_pages_and_system_faults_them_again():
    out = {}
    children = {  # at once: each counts its own page faults
        mode: subprocess.Popen(
            [sys.executable, "-c", CHILD, mode], stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        for mode in ("retain", "system")
    }
    for mode, child in children.items():
        stdout, stderr = child.communicate(timeout=300)
        assert child.returncode == 0, stderr.decode()
        retained, faults = stdout.decode().split()
        out[mode] = (retained == "True", int(faults))
    assert out["retain"][0] and not out["system"][0]
    # system: every round maps the block afresh (>= 48 faults of 2 MiB huge pages, or
    # ~24k of 4 KiB); retain: the same pages every round, next to no faults
    assert out["system"][1] >= 48 // 2
    assert out["retain"][1] < out["system"][1] / 10


def test_host_memory_key_is_checked():
    assert load_config("debug").train.host_memory == "retain"
    with pytest.raises(ConfigError, match="train.host_memory"):
        load_config("debug", ["--train.host_memory=keep"]).validate()


# A hole in the middle of the heap under retain: a 256 MiB block freed below a block
# still live, as a table's initial draw is below the next table's; malloc keeps its
# pages until release_free_memory.
HOLE_CHILD = """
import torch
from recscale.train.host_memory import anon_memory, release_free_memory, set_host_memory
torch.set_num_threads(1)
assert set_host_memory("retain")
hole = torch.empty(64 << 20).fill_(1.0)  # 256 MiB, written
above = torch.empty(1 << 20).fill_(1.0)  # 4 MiB, stays (keeps the hole off the top)
del hole
kept = anon_memory()
freed = release_free_memory()
print(kept, anon_memory(), freed, float(above.sum()))
"""


@pytest.mark.skipif(_glibc() is None, reason="malloc tuning is glibc's")
def test_release_gives_back_a_retained_hole_and_keeps_live_blocks():
    r = subprocess.run([sys.executable, "-c", HOLE_CHILD], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    kept, after, freed, live = r.stdout.split()
    assert int(kept) - int(after) >= 200 << 20  # most of the 256 MiB hole went back
    # what it reports is what went (the process's own small allocations aside)
    assert abs(int(freed) - (int(kept) - int(after))) < 8 << 20
    assert float(live) == float(1 << 20)  # the block above it is intact


# When each mode is in force, in a child process (mallopt is process-wide): the model is
# built and the caches warmed under malloc's own behaviour, the steps under retain - and
# so again in a second run in the same process, the first having left retain on.
PHASES_CHILD = """
import recscale.bench.throughput as bench
import recscale.train.run as run
from recscale.config import load_config
from recscale.train.host_memory import retained
seen = []
def spy(module, name):
    real = getattr(module, name)
    def spied(*a, **k):
        seen.append(f"{name}:{retained()}")
        return real(*a, **k)
    setattr(module, name, spied)
spy(run, "warm_caches"); spy(run, "train_loop"); spy(bench, "warm_caches")
quiet = lambda _m: None
for _ in range(2):
    run.train(load_config("debug", ["--train.steps=2", "--data.eval_samples=256"]), echo=quiet)
r = bench.run_throughput(load_config("debug"), steps=2, warmup=1, echo=quiet)
seen.append(f"bench_retained:{r['host_memory_retained']}")
print(" ".join(seen))
"""


@pytest.mark.skipif(_glibc() is None, reason="malloc tuning is glibc's")
def test_initialization_runs_under_malloc_defaults_and_steps_under_retain():
    r = subprocess.run([sys.executable, "-c", PHASES_CHILD], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [
        "warm_caches:False",
        "train_loop:True",
        "warm_caches:False",
        "train_loop:True",
        "warm_caches:False",
        "bench_retained:True",
    ]
