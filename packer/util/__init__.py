"""Small helpers the build side shares; none of them is a stage of the pipeline.

They are a leaf, the bottom layer of the build side (``tests/test_layers.py``, layer "util"):
below :mod:`packer.errors`, the one way in (:mod:`packer.reading`) and the doors to the
runtime's facts, they import nothing of packer but each other and the runtime, and raise the
caller's error class (``error=``). Helpers that open files stay above, in the shared layer:
:mod:`packer.hashing` (a file's or a span's sha256), :mod:`packer.filetree` (link or copy, a
tree's disk usage), :mod:`packer.safetensors_header` (the build side's one safetensors header
reader). Any module above may use these:

* :mod:`~packer.util.fsutil`: atomic writes, the hash thread of a stream being written, canonical
  JSON, a file's record (:class:`~packer.util.fsutil.FileEntry`).
* :mod:`~packer.util.idents`: the grammar of digests, refs, revisions and names from inputs;
  paths proven inside their root.
* :mod:`~packer.util.jsonshape`: bounded JSON parsing and declarative shape checks.
* :mod:`~packer.util.show`: text from an input shown with visible escapes, never interpreted.
* :mod:`~packer.util.tarfmt`: reproducible tar headers shared by the bundle and the image layers.
* :mod:`~packer.util.timing`: the build's stage timer.
* :mod:`~packer.util.formats`: file names, weight-file patterns and cast dtypes, spelled once.

The one way in and the errors stay at packer's top level: they are rules of the whole build,
not helpers.
"""
