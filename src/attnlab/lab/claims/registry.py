"""The claims registry: each claim of the seed texts, the experiment that measures it,
and the verdict the measurement gives.

A claim is registered by decorating its experiment, a function of no arguments that
runs attnlab (and torch as a reference) and returns an :class:`Outcome`::

    @claim("softmax-simplex", title="softmax rows lie on the probability simplex",
           seed=SEED_002, quote="Each row $\\alpha_{i\\cdot}$ is a probability distribution ...")
    def _():
        p = attnlab.attention_probs(q, k)
        err = float((p.sum(-1) - 1).abs().max())
        return Outcome.judge(err < 1e-6, evidence={"max |row sum - 1|": err},
                             explanation="...", key_figure=f"max |Σ-1| = {err:.1e}")

The quote must occur verbatim (whitespace-normalized) in the named seed file
(``tests/lab/test_claims.py`` checks it).  Nothing is hard-coded: the verdict is
whatever the measurement says at call time, so a broken implementation flips it.

The registry is open: any module can ``from attnlab.lab.claims import claim`` and
register more; listing the module in :data:`attnlab.lab.claims.CLAIM_MODULES` makes
:func:`run_claims` (and ``attnlab claims``) import it.

>>> from attnlab.lab.claims.registry import Registry, Outcome, Verdict
>>> reg = Registry()
>>> @reg.claim("two-plus-two", title="2 + 2 = 4", seed="arith.txt", quote="two and two make four")
... def _():
...     return Outcome.judge(2 + 2 == 4, evidence={"sum": 2 + 2}, explanation="measured", key_figure="2+2 = 4")
>>> [r.verdict for r in reg.run(progress=False)]
[<Verdict.HOLDS: 'holds'>]
"""

from __future__ import annotations

import contextlib
import importlib
import json
import math
import os
import re
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

__all__ = [
    "Verdict",
    "Outcome",
    "Claim",
    "ClaimResult",
    "Registry",
    "REGISTRY",
    "claim",
    "register",
    "all_claims",
    "select",
    "run_claims",
    "format_table",
    "format_list",
    "format_claim",
    "as_document",
    "to_json",
    "seed_path",
    "normalize",
    "quote_found",
    "SEED_000",
    "SEED_002",
]

SEED_000 = "000_54200aed1688a4a7.txt"
SEED_002 = "002_83a9a7f90d84fd2e.txt"


class Verdict(str, Enum):
    """What a measurement says about a claim (compares equal to its string value)."""

    HOLDS = "holds"
    DOES_NOT_HOLD = "does not hold"
    HOLDS_UNDER_CONDITIONS = "holds under conditions"

    def __str__(self) -> str:
        return self.value


def _jsonable(x):
    """Evidence values as JSON: floats (nan/inf as strings), ints, bools, strings, lists, dicts."""
    if isinstance(x, bool) or x is None or isinstance(x, (int, str)):
        return x
    if isinstance(x, float):
        return x if math.isfinite(x) else str(x)
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if hasattr(x, "tolist"):  # tensors, numpy scalars
        return _jsonable(x.tolist())
    return str(x)


@dataclass(frozen=True)
class Outcome:
    """What an experiment returns.

    ``evidence`` is a small dict of measured numbers (name -> number, bool, string or a
    short list); ``explanation`` one line saying what the numbers mean; ``conditions``
    states the conditions when (and only when) the verdict is
    ``HOLDS_UNDER_CONDITIONS``; ``key_figure`` is the short string the table shows.
    """

    verdict: Verdict
    evidence: dict
    explanation: str
    conditions: str | None = None
    key_figure: str = ""

    def __post_init__(self):
        v = Verdict(self.verdict)
        object.__setattr__(self, "verdict", v)
        if not isinstance(self.evidence, dict) or not self.evidence:
            raise ValueError("Outcome.evidence: expected a non-empty dict of measured numbers")
        if not isinstance(self.explanation, str) or not self.explanation.strip() or "\n" in self.explanation:
            raise ValueError("Outcome.explanation: expected a one-line, non-empty string")
        if (v is Verdict.HOLDS_UNDER_CONDITIONS) != bool(self.conditions):
            raise ValueError(
                "Outcome.conditions: state the conditions exactly when the verdict is "
                f"'holds under conditions' (verdict {v.value!r}, conditions {self.conditions!r})"
            )
        object.__setattr__(self, "evidence", _jsonable(self.evidence))

    @classmethod
    def judge(
        cls,
        ok: bool,
        *,
        evidence: dict,
        explanation: str,
        key_figure: str = "",
        conditions: str | None = None,
        otherwise: Verdict = Verdict.DOES_NOT_HOLD,
    ) -> Outcome:
        """``HOLDS`` (or ``HOLDS_UNDER_CONDITIONS`` when ``conditions`` is given) if ``ok``,
        else ``otherwise`` (default ``DOES_NOT_HOLD``, whose conditions are dropped)."""
        if ok:
            v = Verdict.HOLDS_UNDER_CONDITIONS if conditions else Verdict.HOLDS
        else:
            v, conditions = Verdict(otherwise), (conditions if otherwise == Verdict.HOLDS_UNDER_CONDITIONS else None)
        return cls(v, evidence, explanation, conditions, key_figure)


@dataclass(frozen=True)
class Claim:
    """One checkable sentence (or a few) of a seed text and the experiment that tests it."""

    id: str
    title: str
    seed: str  # file name under the seeds folder, e.g. SEED_002
    quotes: tuple[str, ...]  # exact sentence(s) from the seed
    experiment: Callable[[], Outcome] = field(repr=False, compare=False)
    module: str = ""
    tags: tuple[str, ...] = ()


@dataclass
class ClaimResult:
    """A claim and what its experiment measured (or the error it raised)."""

    claim: Claim
    verdict: Verdict | None
    evidence: dict
    explanation: str
    conditions: str | None
    key_figure: str
    seconds: float
    error: str | None = None

    @property
    def id(self) -> str:
        return self.claim.id

    @property
    def ok(self) -> bool:
        """True when the experiment ran (whatever the verdict)."""
        return self.error is None

    def as_dict(self) -> dict:
        c = self.claim
        return {
            "id": c.id,
            "title": c.title,
            "seed": c.seed,
            "quotes": list(c.quotes),
            "module": c.module,
            "tags": list(c.tags),
            "verdict": None if self.verdict is None else self.verdict.value,
            "conditions": self.conditions,
            "key_figure": self.key_figure,
            "evidence": self.evidence,
            "explanation": self.explanation,
            "seconds": round(self.seconds, 3),
            "error": self.error,
        }


def _seed_name(seed: str) -> str:
    """The short name a seed goes by in tables: ``"000"`` for ``000_54200aed1688a4a7.txt``."""
    return seed.split("_")[0]


def _seed_matches(seed: str, s: str) -> bool:
    return s in (seed, _seed_name(seed), seed.rsplit(".", 1)[0])


class Registry:
    """An ordered set of claims; :data:`REGISTRY` is the project's."""

    def __init__(self):
        self._claims: dict[str, Claim] = {}

    def register(self, c: Claim) -> Claim:
        if not re.fullmatch(r"[a-z0-9][a-z0-9-]*", c.id):
            raise ValueError(f"claim id {c.id!r}: use lowercase letters, digits and '-'")
        old = self._claims.get(c.id)
        if old is not None and (old.module, getattr(old.experiment, "__qualname__", None)) != (
            c.module,
            getattr(c.experiment, "__qualname__", None),
        ):
            raise ValueError(f"claim id {c.id!r} is already registered by {old.module}")
        self._claims[c.id] = c
        return c

    def claim(self, id: str, *, title: str, seed: str, quote: str | Sequence[str], tags: Iterable[str] = ()):
        """Decorator: register the decorated experiment ``() -> Outcome`` as claim ``id``."""
        quotes = (quote,) if isinstance(quote, str) else tuple(quote)
        if not quotes or not all(isinstance(q, str) and q.strip() for q in quotes):
            raise ValueError(f"claim {id!r}: quote must be a non-empty sentence (or sentences) from the seed")

        def deco(fn: Callable[[], Outcome]) -> Callable[[], Outcome]:
            self.register(Claim(id, title, seed, quotes, fn, getattr(fn, "__module__", ""), tuple(tags)))
            return fn

        return deco

    def __iter__(self):
        return iter(list(self._claims.values()))

    def __len__(self):
        return len(self._claims)

    def __getitem__(self, id: str) -> Claim:
        return self._claims[id]

    def select(self, ids: Iterable[str] | None = None) -> list[Claim]:
        """Claims whose id equals, or contains, one of ``ids`` (all when ``ids`` is None); an
        entry that is no part of any id selects the claims of the seed it names (``"000"``,
        the seed's file name, or its stem).  An entry that matches nothing raises ``ValueError``."""
        claims = list(self._claims.values())
        if ids is None:
            return claims
        ids = [ids] if isinstance(ids, str) else list(ids)
        out, seen = [], set()
        for s in ids:
            exact = [c for c in claims if c.id == s]
            hits = exact or [c for c in claims if s in c.id] or [c for c in claims if _seed_matches(c.seed, s)]
            if not hits:
                seeds = sorted({_seed_name(c.seed) for c in claims})
                raise ValueError(
                    f"no claim matches {s!r} (not an id, a part of one, or a seed: "
                    f"{', '.join(seeds)}); `attnlab claims --list` lists them"
                )
            for c in hits:
                if c.id not in seen:
                    seen.add(c.id)
                    out.append(c)
        return out

    def run(
        self, ids: Iterable[str] | None = None, *, progress: bool = True, threads: int | None = 1
    ) -> list[ClaimResult]:
        """Run the selected claims' experiments, in registration order, with torch limited
        to ``threads`` intra-op threads (restored afterwards; None leaves it alone): the
        experiments are small, and extra threads only oversubscribe a busy machine."""
        claims = self.select(ids)
        with _threads(threads):
            return [_run_one(c) for c in _progress(claims, progress)]


@contextlib.contextmanager
def _threads(n: int | None):
    import torch

    old = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _progress(claims: list[Claim], progress: bool):
    if not progress:
        return claims
    from tqdm.auto import tqdm

    bar = tqdm(claims, desc="claims", unit="claim", file=sys.stderr, leave=False)

    def it():
        for c in bar:
            bar.set_postfix_str(c.id)
            yield c

    return it()


def _run_one(c: Claim) -> ClaimResult:
    t0 = time.perf_counter()
    try:
        out = c.experiment()
        if not isinstance(out, Outcome):
            raise TypeError(f"experiment of {c.id!r} returned {type(out).__name__}, expected an Outcome")
    except Exception as e:  # noqa: BLE001 - a failing experiment is reported, not a verdict
        tb = traceback.format_exception_only(type(e), e)[-1].strip()
        return ClaimResult(c, None, {}, "", None, "", time.perf_counter() - t0, error=tb)
    return ClaimResult(
        c,
        out.verdict,
        out.evidence,
        out.explanation,
        out.conditions,
        out.key_figure or _first_figure(out.evidence),
        time.perf_counter() - t0,
    )


def _first_figure(evidence: dict) -> str:
    k, v = next(iter(evidence.items()))
    return f"{k} = {v:.3g}" if isinstance(v, float) else f"{k} = {v}"


REGISTRY = Registry()
claim = REGISTRY.claim
register = REGISTRY.claim  # the name other modules use: ``@register("my-claim", ...)``


def _load_modules() -> None:
    from attnlab.lab import claims as pkg

    for name in pkg.CLAIM_MODULES:
        importlib.import_module(name)


def all_claims() -> list[Claim]:
    """Every registered claim, after importing :data:`attnlab.lab.claims.CLAIM_MODULES`."""
    _load_modules()
    return list(REGISTRY)


def select(ids: Iterable[str] | None = None) -> list[Claim]:
    """The claims matching ``ids`` (ids or substrings of ids; all when None)."""
    _load_modules()
    return REGISTRY.select(ids)


def run_claims(
    ids: Iterable[str] | None = None, *, progress: bool = True, threads: int | None = 1, workers: int = 1
) -> list[ClaimResult]:
    """Run the experiments of the claims matching ``ids`` (ids or substrings; all when
    None), with a tqdm bar on stderr when ``progress``, torch limited to ``threads``
    threads meanwhile.  An experiment that raises gives a result with ``verdict=None``
    and ``error`` set; the others still run.

    ``workers > 1`` runs the experiments on that many spawned processes (a fresh
    interpreter each: no forked OpenMP state), one claim at a time to whichever is free;
    the results come back in registration order, as with one worker.  Each worker imports
    :data:`attnlab.lab.claims.CLAIM_MODULES` itself, so only those claims run there, and
    nothing patched in this process (a monkeypatch, a claim registered elsewhere) reaches
    them: tests that patch keep ``workers=1``."""
    _load_modules()
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise ValueError(f"workers: expected a positive int, got {workers!r}")
    claims = REGISTRY.select(ids)
    if workers == 1 or len(claims) < 2:
        return REGISTRY.run(ids, progress=progress, threads=threads)
    return _run_on_workers(claims, progress=progress, threads=threads, workers=workers)


def _run_on_workers(claims: list[Claim], *, progress: bool, threads: int | None, workers: int) -> list[ClaimResult]:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    ctx = multiprocessing.get_context("spawn")
    out: dict[str, ClaimResult] = {}
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(claims), desc=f"claims on {workers} processes", unit="claim", file=sys.stderr, leave=False)
    with ProcessPoolExecutor(min(workers, len(claims)), mp_context=ctx) as pool:
        futures = {pool.submit(_worker_run, c.id, threads): c for c in claims}
        for f in as_completed(futures):
            c = futures[f]
            try:
                fields = f.result()
            except Exception as e:  # noqa: BLE001 - a worker that died is reported as that claim's error
                fields = (None, {}, "", None, "", 0.0, f"worker: {type(e).__name__}: {e}")
            verdict, *rest = fields
            out[c.id] = ClaimResult(c, None if verdict is None else Verdict(verdict), *rest)
            if bar is not None:
                bar.set_postfix_str(c.id)
                bar.update(1)
    if bar is not None:
        bar.close()
    return [out[c.id] for c in claims]


def _worker_run(claim_id: str, threads: int | None) -> tuple:
    """In a worker process: run one registered claim, return its result's fields (the
    verdict as its value; the claim itself stays in the parent)."""
    _load_modules()
    with _threads(threads):
        r = _run_one(REGISTRY[claim_id])
    return (
        None if r.verdict is None else r.verdict.value,
        r.evidence,
        r.explanation,
        r.conditions,
        r.key_figure,
        r.seconds,
        r.error,
    )


# ----------------------------------------------------------------------------- output
def _wrap(text: str, width: int) -> list[str]:
    """``text`` in lines of at most ``width`` characters (words longer than that are split)."""
    import textwrap

    return textwrap.wrap(text, width, break_long_words=True, break_on_hyphens=False) or [""]


def format_table(results: Sequence[ClaimResult], *, width: int = 56) -> str:
    """A terminal table: id, verdict, key figure, seed; then a count of verdicts.  A key
    figure (or error) longer than ``width`` wraps onto the following lines: nothing is cut."""
    head = ("claim", "verdict", "key figure", "seed")
    rows = []
    for r in results:
        verdict = "ERROR" if r.verdict is None else r.verdict.value
        fig = r.error if r.verdict is None else r.key_figure
        rows.append((r.id, verdict, _wrap(fig or "", width), _seed_name(r.claim.seed)))
    w = [max([len(head[i])] + [len(row[i]) for row in rows]) for i in (0, 1)]
    w.append(max([len(head[2])] + [len(x) for row in rows for x in row[2]]))
    w.append(max([len(head[3])] + [len(row[3]) for row in rows]))

    def line(cells):
        return "  ".join(cell.ljust(w[i]) for i, cell in enumerate(cells)).rstrip()

    lines = [line(head), "  ".join("-" * x for x in w)]
    for cid, verdict, figs, seed in rows:
        lines.append(line((cid, verdict, figs[0], seed)))
        lines += [line(("", "", more, "")) for more in figs[1:]]
    counts: dict[str, int] = {}
    for r in results:
        k = "error" if r.verdict is None else r.verdict.value
        counts[k] = counts.get(k, 0) + 1
    order = [v.value for v in Verdict] + ["error"]
    lines.append("")
    lines.append(f"{len(results)} claims: " + ", ".join(f"{counts[k]} {k}" for k in order if k in counts))
    return "\n".join(lines)


def format_list(claims: Sequence[Claim]) -> str:
    """One line per claim: id, seed, title (what ``attnlab claims --list`` prints)."""
    w = max((len(c.id) for c in claims), default=0)
    return "\n".join(f"{c.id.ljust(w)}  {_seed_name(c.seed)}  {c.title}" for c in claims)


def format_claim(r: ClaimResult, *, width: int = 88) -> str:
    """One claim whole: its title, the seed's quote(s), the verdict and why, the conditions
    (when it holds only under them), every measured figure, and how long it took."""
    c = r.claim
    out = [f"{c.id}: {c.title}", "", f"seed {_seed_name(c.seed)} ({c.seed}) says:"]
    for q in c.quotes:
        out += ["  " + x for x in _wrap(f"“{normalize(q)}”", width - 2)]
    out.append("")
    if r.verdict is None:
        out += ["verdict: ERROR (the experiment raised)"] + ["  " + x for x in _wrap(r.error or "", width - 2)]
        return "\n".join(out)
    out.append(f"verdict: {r.verdict.value}")
    out += ["  " + x for x in _wrap(f"why: {r.explanation}", width - 2)]
    out += ["  " + x for x in _wrap(f"conditions: {r.conditions or 'none (the verdict is unconditional)'}", width - 2)]
    out += ["", "measured:"]
    kw = max(len(str(k)) for k in r.evidence) if r.evidence else 0
    for k, v in r.evidence.items():
        text = (
            f"{v:.4g}"
            if isinstance(v, float)
            else json.dumps(v, ensure_ascii=False)
            if isinstance(v, (list, dict))
            else str(v)
        )
        out += [
            f"  {str(k).ljust(kw)}  {x}" if i == 0 else f"  {'':{kw}}  {x}"
            for i, x in enumerate(_wrap(text, max(20, width - kw - 4)))
        ]
    out += ["", f"key figure: {r.key_figure}", f"({r.seconds:.1f} s; experiment in {c.module})"]
    return "\n".join(out)


def as_document(results: Sequence[ClaimResult]) -> dict:
    """The results as a JSON-able document ``{"claims": [ClaimResult.as_dict(), ...]}``."""
    return {"claims": [r.as_dict() for r in results]}


def to_json(results: Sequence[ClaimResult]) -> str:
    """The results as a JSON document (a list of dicts; see :meth:`ClaimResult.as_dict`)."""
    return json.dumps(as_document(results), indent=2, ensure_ascii=False)


# ----------------------------------------------------------------------------- seeds
def seed_dirs() -> list[Path]:
    """Where seed files are looked for: ``$ATTNLAB_SEEDS``, the copy shipped in the package
    (``lab/claims/seeds/``), then ``../shared/seeds`` next to the working directory and next
    to the source checkout."""
    dirs = []
    if os.environ.get("ATTNLAB_SEEDS"):
        dirs.append(Path(os.environ["ATTNLAB_SEEDS"]))
    dirs.append(Path(__file__).resolve().parent / "seeds")
    dirs.append(Path.cwd().parent / "shared" / "seeds")
    here = Path(__file__).resolve()
    for up in here.parents[:6]:
        dirs.append(up.parent / "shared" / "seeds")
    return dirs


def seed_path(name: str) -> Path | None:
    """The seed file ``name``, or None when no seeds folder is found."""
    for d in seed_dirs():
        p = d / name
        if p.is_file():
            return p
    return None


def normalize(text: str) -> str:
    """Collapse every run of whitespace into one space (for matching quotes)."""
    return " ".join(text.split())


def quote_found(c: Claim) -> list[bool] | None:
    """For each quote of ``c``, whether it occurs in its seed (None if the seed is missing)."""
    p = seed_path(c.seed)
    if p is None:
        return None
    text = normalize(p.read_text(encoding="utf-8"))
    return [normalize(q) in text for q in c.quotes]
