"""A Lightning ``.ckpt`` recognised, and its recipe given in one step.

Lightning saves one pickle: ``state_dict`` holds the ``LightningModule``'s tensors, each named
under the attribute that holds the model (``model.`` for ``self.model = AutoModel...``), beside
``optimizer_states``, ``lr_schedulers``, ``loops``, ``callbacks`` and hyper-parameters. Offered a
choice of keys, a release engineer needs three runs to learn the recipe, and the optimizer's
moments are among the keys offered. Recognised here, the refusal and ``packer inspect`` name the
key and the prefix to strip at once, and call the rest training state.
"""

from __future__ import annotations

import json
import shlex
from collections import Counter
from dataclasses import dataclass

from packer.checkpoint.records import listing
from packer.checkpoint.tree import children, tensor_counts

MODEL_KEY = "state_dict"
# keys only Lightning writes: one of them beside state_dict marks the file as Lightning's
_MARKS = frozenset({"pytorch-lightning_version", "optimizer_states", "lr_schedulers", "loops"})


@dataclass(frozen=True)
class LightningRecipe:
    """How to convert a Lightning checkpoint's model.

    Attributes:
        tensors: how many tensors ``state_dict`` holds.
        prefix: the attribute prefix to strip (``"model."``), or None when the names share none.
        attributes: every top-level attribute of ``state_dict`` with its tensor count, largest first.
        training: the other top-level entries holding tensors (optimizer, scheduler, callbacks).
    """

    tensors: int
    prefix: str | None
    attributes: tuple[tuple[str, int], ...]
    training: tuple[str, ...]

    @property
    def several(self) -> bool:
        """True when the module's tensors lie under more than one attribute (a loss, a teacher)."""
        return len(self.attributes) > 1

    def flags(self) -> str:
        """The ``packer convert`` flags of the recipe, quoted for a POSIX shell."""
        if self.prefix is None:
            return f"--key {MODEL_KEY}"
        keep = f" --include {shlex.quote(self.prefix + '*')}" if self.several else ""
        return f"--key {MODEL_KEY}{keep} --strip-prefix {shlex.quote(self.prefix)}"

    def recipe(self) -> str:
        """The same recipe as ``[weights]`` keys (TOML values)."""
        if self.prefix is None:
            return f'weights.key = "{MODEL_KEY}"'
        keep = f"weights.include = [{json.dumps(self.prefix + '*')}], " if self.several else ""
        return f'weights.key = "{MODEL_KEY}", {keep}weights.strip_prefixes = [{json.dumps(self.prefix)}]'

    def describe(self) -> str:
        """One sentence: where the model is, the flags, the recipe keys, what is training state."""
        if self.prefix is None:
            named = "with no common attribute prefix"
        elif self.several:
            parts = ", ".join(f"{a}. ({n})" for a, n in self.attributes)
            named = f"under several attributes ({parts}), the model most likely under {self.prefix}"
        else:
            named = f"each named with the prefix {self.prefix} (the LightningModule's attribute)"
        rest = f"; {listing(self.training)} {'is' if len(self.training) == 1 else 'are'} training state, " \
            "not model weights" if self.training else ""
        return (f"a Lightning checkpoint: the model's {self.tensors} tensors are under {MODEL_KEY}, {named}; "
                f"convert with {self.flags()} (recipe: {self.recipe()}){rest}")


def lightning_recipe(root: object) -> LightningRecipe | None:
    """The recipe of a Lightning checkpoint's unpickled ``root``, or None for any other file.

    Args:
        root: the unpickled tree (plain containers with tensor leaves).

    Returns:
        The recipe when ``root`` has a ``state_dict`` of tensors beside a key only Lightning
        writes, else None.
    """
    kids = children(root)
    if kids is None or not isinstance(root, dict):
        return None
    top = dict(kids)
    model = top.get(MODEL_KEY)
    if not isinstance(model, dict) or not _MARKS & top.keys():
        return None
    counts = tensor_counts(root)
    if not counts.get(id(model), 0):
        return None
    names = [n for n, _ in children(model) or []]
    ranked = tuple(sorted(Counter(n.split(".", 1)[0] for n in names).items(), key=lambda a: (-a[1], a[0])))
    prefix = None
    if ranked and any(n.startswith(f"{ranked[0][0]}.") for n in names) and \
            (len(ranked) == 1 or ranked[0][1] > ranked[1][1]):  # two of one size: not ours to guess
        prefix = f"{ranked[0][0]}."
    training = tuple(n for n, v in kids if n != MODEL_KEY and counts.get(id(v), 0))
    return LightningRecipe(counts[id(model)], prefix, ranked, training)
