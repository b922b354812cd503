"""Verifiers by draft kind and name: one registry for the engine and the commands.

Draft kinds: ``"chain"`` (a linear block, `Verifier`) and ``"tree"`` (a flattened token tree,
`TreeWalkVerifier`-like). At temperature 0 every draft is verified greedily (the ``"greedy"``
entry of its kind), whatever name is configured; at T > 0 the configured name picks one.
A new verifier is one `register_verifier` call.
"""

from __future__ import annotations

from specjax.verify._block import BlockVerifier
from specjax.verify._greedy import GreedyVerifier
from specjax.verify._token import TokenVerifier
from specjax.verify._traversal import TraversalVerifier
from specjax.verify._tree import GreedyTreeVerifier, RecursiveRejectionVerifier

DRAFT_KINDS = ("chain", "tree")
_VERIFIERS: dict[tuple[str, str], type] = {}


def register_verifier(draft: str, name: str, cls: type) -> None:
    """Make ``cls()`` the verifier ``name`` of ``draft`` blocks ('chain' or 'tree'); 'greedy' is the
    one used at temperature 0."""
    if draft not in DRAFT_KINDS:
        raise ValueError(f"draft must be one of {DRAFT_KINDS}, got {draft!r}")
    old = _VERIFIERS.get((draft, name))
    if old is not None and old is not cls:
        raise ValueError(f"a {draft} verifier {name!r} is already registered ({old.__name__})")
    _VERIFIERS[(draft, name)] = cls


def verifier_names(draft: str) -> tuple[str, ...]:
    """The names of ``draft``'s verifiers a config may choose (the greedy one is implied)."""
    return tuple(n for d, n in _VERIFIERS if d == draft and n != "greedy")


def get_verifier(draft: str, name: str, greedy: bool = False):
    """The verifier of ``draft`` blocks: the greedy one when ``greedy``, else the one named."""
    key = (draft, "greedy" if greedy else name)
    if key not in _VERIFIERS:
        raise ValueError(f"unknown {draft} verifier {name!r} (registered: {', '.join(verifier_names(draft))})")
    return _VERIFIERS[key]()


for _draft, _name, _cls in (("chain", "greedy", GreedyVerifier), ("chain", "token", TokenVerifier),
                            ("chain", "block", BlockVerifier), ("tree", "greedy", GreedyTreeVerifier),
                            ("tree", "traversal", TraversalVerifier),
                            ("tree", "recursive", RecursiveRejectionVerifier)):
    register_verifier(_draft, _name, _cls)
