"""Small helpers the build side shares; none of them is a stage of the pipeline.

They sit in the bottom layer of the build side with :mod:`packer.errors` and the one way in,
:mod:`packer.reading` (``tests/test_layers.py``), which some of them use; any module above may
use them:

* :mod:`~packer.util.fsutil`: atomic writes, hashing, canonical JSON, link-or-copy.
* :mod:`~packer.util.idents`: the grammar of digests, refs, revisions and names from inputs;
  paths proven inside their root.
* :mod:`~packer.util.jsonshape`: bounded JSON parsing and declarative shape checks.
* :mod:`~packer.util.show`: text from an input shown with visible escapes, never interpreted.
* :mod:`~packer.util.tarfmt`: reproducible tar headers shared by the bundle and the image layers.
* :mod:`~packer.util.timing`: the build's stage timer.
* :mod:`~packer.util.formats`: file names, weight-file patterns and cast dtypes, spelled once.
* :mod:`~packer.util.safetensors_header`: the build side's one safetensors header reader.

The one way in and the errors stay at packer's top level: they are rules of the whole build,
not helpers.
"""
