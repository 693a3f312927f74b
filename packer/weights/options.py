"""How the weights stage runs: one value, made once by its caller and passed through unchanged.

What the stage converts is the recipe's ``[weights]`` section (:class:`packer.recipe.WeightsConfig`);
how it runs is :class:`ConvertOptions`, made by ``packer build``'s weights stage
(:func:`packer.build_stages.weights_stage`) or by ``packer convert``, and handed to
:func:`packer.weights.stage.convert_layout`, :func:`packer.weights.sandbox.convert_cli` and the
sandbox's child as it is.
"""

from __future__ import annotations

from dataclasses import dataclass

from packer.recipe import ImageConfig
from packer.stage import Progress


@dataclass(frozen=True)
class ConvertOptions:
    """How one conversion runs.

    Attributes:
        dry_run: plan only: the result's section describes what would be written; nothing is.
        sandbox: read the input in an isolated child process (:mod:`packer.weights.sandbox`);
            False reads it in this process.
        progress: called with the bytes just written (increments, see
            :data:`packer.stage.Progress`), with or without the sandbox; None: not reported.
        verify: the writer reads each span back as it lands and re-parses its outputs
            (:func:`packer.weights.convert.convert`). False is only for a caller that re-hashes
            every file written, as ``packer build`` does (its final verify); ``packer convert``
            re-hashes nothing, so it keeps the default.
        layer_image: the image whose weight layers frame each weight file
            (:func:`packer.oci.plan.weight_layer_framing`): each file's layer digest is computed
            while it is written and returned in ``digests`` (``"layer:<path>"`` →
            ``"sha256:…"``). None: no layer framing.
        layer_blobs: with ``layer_image``, write each weight file as its layer blob instead
            (its one copy in OUT), hashed by neither digest: the caller re-reads and names it,
            as ``packer build`` does (:mod:`packer.oci.reread`).
        layer_mtime: with ``layer_image``, the layer entries' mtime in seconds since the epoch;
            None: ``SOURCE_DATE_EPOCH`` (0 when unset), read by the process that starts the
            conversion.
    """

    dry_run: bool = False
    sandbox: bool = True
    progress: Progress | None = None
    verify: bool = True
    layer_image: ImageConfig | None = None
    layer_blobs: bool = False
    layer_mtime: int | None = None
