"""Known Lightning/torch mismatches that a user's run should not have to see."""

from __future__ import annotations

import warnings

# Lightning 2.6's CombinedLoader flattens batches with its own copy of torch's pytree code,
# which builds ``LeafSpec()``; torch 2.13 deprecated that and warns once per process in every
# fit(). Nothing the user can act on, so it is filtered -- exactly that message, nothing else.
_LEAFSPEC_MESSAGE = r"`isinstance\(treespec, LeafSpec\)` is deprecated"


def silence_known_warnings() -> None:
    """Install the filters (idempotent: ``warnings`` de-duplicates identical filters)."""
    for category in (FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", message=_LEAFSPEC_MESSAGE, category=category)
