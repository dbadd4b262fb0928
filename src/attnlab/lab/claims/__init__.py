"""``attnlab claims``: the seed texts' checkable claims, each tied to an experiment.

Every claim quotes the seed sentence(s) it tests, runs attnlab (and torch as a
reference) at call time and returns a verdict — ``holds``, ``does not hold`` or
``holds under conditions`` (with the conditions) — with a small dict of measured
numbers and a one-line explanation.  Nothing is hard-coded: break attnlab and the
verdicts move.

Adding a claim: in any module, decorate an experiment of no arguments that returns an
:class:`Outcome`, and list the module in :data:`CLAIM_MODULES` (or import it before
calling :func:`run_claims`)::

    from attnlab.lab.claims import SEED_002, Outcome, register

    @register("my-claim", title="what the seed asserts", seed=SEED_002,
              quote="the exact sentence from the seed")
    def _my_claim() -> Outcome:
        measured = ...   # run attnlab here
        return Outcome.judge(measured < 1e-6, evidence={"error": measured},
                             explanation="one line", key_figure=f"error {measured:.1e}")

>>> from attnlab.lab.claims import select
>>> c = select(["rope-relative"])[0]
>>> c.seed, c.module
('002_83a9a7f90d84fd2e.txt', 'attnlab.lab.claims.positions')
"""

from attnlab.lab.claims.registry import (
    REGISTRY,
    SEED_000,
    SEED_002,
    Claim,
    ClaimResult,
    Outcome,
    Registry,
    Verdict,
    all_claims,
    as_document,
    claim,
    format_claim,
    format_list,
    format_table,
    quote_found,
    register,
    run_claims,
    seed_path,
    select,
    to_json,
)

#: Modules whose import registers claims; :func:`run_claims` imports them in this order.
#: Other parts of the lab add their own module here.
CLAIM_MODULES = [
    "attnlab.lab.claims.scores",
    "attnlab.lab.claims.softmax",
    "attnlab.lab.claims.multihead",
    "attnlab.lab.claims.circuits",
    "attnlab.lab.claims.positions",
    "attnlab.lab.claims.masking",
    "attnlab.lab.claims.inference",
    "attnlab.lab.claims.experiments",
    "attnlab.lab.claims.alternatives",
]

__all__ = [
    "CLAIM_MODULES",
    "SEED_000",
    "SEED_002",
    "REGISTRY",
    "Claim",
    "ClaimResult",
    "Outcome",
    "Registry",
    "Verdict",
    "all_claims",
    "as_document",
    "claim",
    "format_claim",
    "format_list",
    "format_table",
    "quote_found",
    "register",
    "run_claims",
    "seed_path",
    "select",
    "to_json",
]
