"""Shared fixtures for every suite. Keep this small and additive."""

from __future__ import annotations

import os
import sys

import pytest

# Ablation (and anyone testing a source tree) points the suites at another SGLang
# source tree: ``HARNESS_SGLANG_PATH=<tree>/python``. It goes first on sys.path here
# and on PYTHONPATH for spawned ranks, before anything imports sglang.
_SGLANG_PATH = os.environ.get("HARNESS_SGLANG_PATH")
if _SGLANG_PATH:
    sys.path.insert(0, _SGLANG_PATH)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (_SGLANG_PATH, os.environ.get("PYTHONPATH")) if p
    )


def pytest_addoption(parser):
    parser.addoption(
        "--guards",
        action="append",
        default=[],
        metavar="PATCH_ID",
        help="only run the regression tests marked @pytest.mark.guards(PATCH_ID)",
    )
    parser.addoption(
        "--e2e",
        action="store_true",
        default=False,
        help="also run the real-engine tier (tests/e2e, marked e2e): `make e2e`",
    )


def pytest_configure(config):
    # One OpenMP thread per process, as torchrun sets for more than one process per host:
    # the suites run two workers plus up to seven rank processes on two cores, and each
    # one's default intra-op pool (a thread per core, spin-waiting) only fought the others
    # for them. Tiny tensors gain nothing from it. Set before any process here imports
    # torch (xdist workers, forkservers and ranks inherit it); an explicit value wins.
    # The real-engine tier (--e2e) keeps SGLang's own threading.
    if not config.getoption("--e2e"):
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    config.addinivalue_line(
        "markers", "guards(patch_id): regression test for the patch with that Patch-Id"
    )
    config.addinivalue_line("markers", "multirank: spawns rank pools (TP > 1)")
    config.addinivalue_line(
        "markers", "world_size(n): needs a rank pool of n ranks (started early, see below)"
    )
    config.addinivalue_line("markers", "gpu: needs CUDA")
    config.addinivalue_line(
        "markers", "e2e: runs SGLang's real Engine (tests/e2e); deselected unless --e2e"
    )
    config.addinivalue_line(
        "markers", "parity: HF parity tier (tests/parity): SGLang's real models against transformers"
    )
    config.addinivalue_line(
        "markers",
        "bases(*versions): the SGLang versions whose base the test runs on (suites "
        "written against their internals); unmarked tests run on the default base only",
    )


# Tests that import SGLang. Those of the "sglang" group run in one xdist worker, so
# SGLang is imported once there (17 s of CPU per import on these machines) while the
# other worker takes the parity tier; in-process tests first, then the multirank ones,
# whose pools that worker starts at its first group test so the ranks import meanwhile.
SGLANG_PATHS = ("tests/patches/", "tests/multirank/", "tests/memory/", "tests/ranks/test_sglang_dist.py",
                "tests/standins/")
SGLANG_GROUP = "sglang"
# In-process SGLang tests that need no rank pool and no order among themselves: the
# stand-ins' checks (several against SGLang's own kernels in a fresh interpreter) and
# the fullgraph traces, over a third of the suite's CPU. Each is its own xdist unit,
# scheduled after both groups, so whichever worker is free takes it (the parity worker
# too, once the tier is done). Without this the "sglang" worker ran 11 min on 0.5.23
# while the parity one idled for 7 of them.
SGLANG_SHARED = ("tests/standins/", "tests/patches/test_model_forward.py::test_forward_traces_fullgraph")
_WORLD_SIZES: set = set()
# The HF parity tier runs SGLang only in rank processes of its own (CPU engine mode, see
# harness/parity/runner.py), driven from one worker: its own group, scheduled second so
# xdist hands it to the other worker than the "sglang" group.
PARITY_PATHS = ("tests/parity/",)
PARITY_GROUP = "parity"


def _needs_sglang(item) -> bool:
    rel = item.nodeid.split("::", 1)[0]
    return rel.startswith(SGLANG_PATHS)


def _in_sglang_group(item) -> bool:
    return _needs_sglang(item) and not item.nodeid.startswith(SGLANG_SHARED)


def _is_parity(item) -> bool:
    return item.nodeid.split("::", 1)[0].startswith(PARITY_PATHS)


E2E_PATH = "tests/e2e/"


def _is_e2e(item) -> bool:
    return item.nodeid.startswith(E2E_PATH) or item.get_closest_marker("e2e") is not None


def pytest_itemcollected(item):
    # Here, not in pytest_collection_modifyitems: xdist's worker reads the group there.
    if _in_sglang_group(item):
        item.add_marker(pytest.mark.xdist_group(SGLANG_GROUP))
    elif _is_e2e(item):
        # One worker runs them all: its driver keeps one Engine per configuration.
        item.add_marker(pytest.mark.e2e)
        item.add_marker(pytest.mark.xdist_group("e2e"))
    elif _is_parity(item):
        item.add_marker(pytest.mark.xdist_group(PARITY_GROUP))


def pytest_collection_modifyitems(config, items):
    _select_e2e(config, items)
    _select_base(config, items)
    _select_guarded(config, items)
    for item in items:
        if _needs_sglang(item):
            for m in item.iter_markers("world_size"):
                _WORLD_SIZES.add(int(m.args[0]))
    # Stable: in-process SGLang tests, then multirank ones, then the parity tier, then the
    # shared SGLang tests, then everything else as is.
    items.sort(key=lambda it: (0 if _in_sglang_group(it) and not it.get_closest_marker("world_size")
                               else 1 if _in_sglang_group(it) else 2 if _is_parity(it)
                               else 3 if _needs_sglang(it) else 4))


def active_base() -> tuple[bool, str]:
    """(whether it is the default base, its SGLang version): ``$HARNESS_BASE`` or the pin."""
    from harness.patchset.layout import layout

    lay = layout()
    return lay.base is None, lay.label


def _select_base(config, items):
    """Keep the tests of the active base (``make test BASE=...``). A test marked
    ``bases(versions...)`` runs on a base whose SGLang version is listed (suites written
    against that version's internals); an unmarked one (the tooling) on the default
    base only."""
    default, version = active_base()
    keep, drop = [], []
    for item in items:
        marker = item.get_closest_marker("bases")
        ok = version in marker.args if marker else default
        (keep if ok else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def _select_e2e(config, items):
    """The real-engine tier costs minutes: only with ``--e2e`` (``make e2e``, ablation)."""
    if config.getoption("--e2e"):
        return
    drop = [item for item in items if _is_e2e(item)]
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = [item for item in items if not _is_e2e(item)]


def _select_guarded(config, items):
    wanted = set(config.getoption("--guards"))
    if not wanted:
        return
    keep, drop = [], []
    for item in items:
        ids = {m.args[0] for m in item.iter_markers("guards")}
        (keep if ids & wanted else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep

SGLANG_INIT = "harness.ranks.sglang:init_sglang_distributed"
SGLANG_PRELOAD = ("harness.ranks.preload",)  # = harness.ranks.sglang.PRELOAD (stdlib-only here)


_PRESTARTED: list = []


@pytest.fixture(autouse=True)
def _prestart_rank_pools(request):
    """At this worker's first SGLang test, start (without waiting) the SGLang rank pools
    its selected multirank tests need; they import SGLang while in-process tests run."""
    if _PRESTARTED or not _in_sglang_group(request.node) or not _WORLD_SIZES:
        yield
        return
    _PRESTARTED.append(True)
    backend = _backend()
    if backend == "gloo":
        from harness.ranks import get_pool

        for n in sorted(_WORLD_SIZES):
            get_pool(n, backend, SGLANG_INIT, wait=False, timeout=900, preload=SGLANG_PRELOAD)
    yield


def _backend() -> str:
    backend = os.environ.get("HARNESS_DIST_BACKEND")
    if backend is None:
        import torch

        backend = "nccl" if torch.cuda.is_available() else "gloo"
    return backend


@pytest.fixture(scope="session")
def rank_pool():
    """Factory: ``rank_pool(world_size, backend=None, init_fn=SGLANG_INIT, **pool_kwargs)``.

    Returns a warm ``harness.ranks.RankPool`` cached per (world_size, backend, init_fn)
    for this pytest worker; a pool broken by a failed case is replaced on the next
    request. Backend: ``$HARNESS_DIST_BACKEND``, else nccl when CUDA is available, else
    gloo. Skips when nccl needs more GPUs than there are. ``pool_kwargs`` (e.g.
    ``timeout=``) only apply when a pool is created.
    """
    from harness.ranks import close_all_pools, get_pool

    def make(world_size: int, backend: str | None = None, init_fn=SGLANG_INIT, **pool_kwargs):
        backend = backend or _backend()
        if backend == "nccl":
            import torch

            n = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if n < world_size:
                pytest.skip(f"backend nccl needs {world_size} GPUs, {n} visible")
        if init_fn == SGLANG_INIT:
            pool_kwargs.setdefault("preload", SGLANG_PRELOAD)
        # Every pool of the session starts at once, each rank importing SGLang: on 2 busy
        # cores the TP 4 pool's start took over 600 s (the pool's default) once.
        pool_kwargs.setdefault("start_timeout", 900)
        return get_pool(world_size, backend, init_fn, **pool_kwargs)

    yield make
    close_all_pools()


@pytest.fixture(scope="session")
def sglang_tp1():
    """SGLang's own distributed state at world size 1 (gloo), in this pytest worker."""
    from harness.ranks.sglang import init_sglang_distributed

    return init_sglang_distributed(rank=0, world_size=1)


@pytest.fixture(scope="session")
def tiny_model(sglang_tp1):
    """SGLang's real DeepseekV2Model (8 layers, CPU stand-ins), built once per worker."""
    from harness.suites.capture import get_model

    return get_model()
