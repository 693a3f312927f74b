"""The tokenizer/config bundle: pick the files loaders read, write one reproducible tar.zst.

Plan, then write, one module per job:

- :mod:`~packer.bundle.select`: :func:`plan_bundle` walks the source and returns the frozen
  :class:`~packer.bundle.plan.BundlePlan` (what ``--dry-run`` prints);
- :mod:`~packer.bundle.tar`: the plan's tar stream (ustar headers; a PAX ``path`` record only
  for a name ustar cannot hold);
- :mod:`~packer.bundle.write`: :func:`write_bundle`, that stream in one multi-threaded zstd
  frame, re-read with the runtime reader before it is renamed into place;
- :mod:`~packer.bundle.stage`: :func:`run_bundle` (the build stage) and :func:`bundle_to_file`
  (``packer bundle``); :mod:`~packer.bundle.extract`: :func:`unbundle`;
- :mod:`~packer.bundle.verify`: :func:`verify_bundle` (``packer verify``).

Reading and extraction live in :mod:`packer.runtime.bundle_reader`, shared with the emitted loader.
"""

from packer.bundle.extract import unbundle
from packer.bundle.plan import BundleMember, BundlePlan
from packer.bundle.select import glob_regex, plan_bundle
from packer.bundle.stage import ARCHIVE_NAME, bundle_to_file, run_bundle
from packer.bundle.tar import ustar_header
from packer.bundle.verify import verify_bundle
from packer.bundle.write import ZSTD_LEVEL, WrittenBundle, write_bundle

__all__ = [
    "ARCHIVE_NAME",
    "ZSTD_LEVEL",
    "BundleMember",
    "BundlePlan",
    "WrittenBundle",
    "bundle_to_file",
    "glob_regex",
    "plan_bundle",
    "run_bundle",
    "unbundle",
    "ustar_header",
    "verify_bundle",
    "write_bundle",
]
