"""``packer push``: copy ``OUT/image``'s image and ModelPack view to a registry with skopeo (no daemon needed)."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from pathlib import Path

from packer.errors import ImageError
from packer.oci.base import REF_NAME
from packer.oci.modelpack import ARTIFACT_TYPE, modelpack_tag


def image_tags(out_dir: Path) -> tuple[str, str | None]:
    """The tags (``org.opencontainers.image.ref.name``) in ``OUT/image``: the image's and the
    ModelPack view's (None when the layout has none).

    Raises:
        ImageError: no readable layout, or not one tagged image (and at most one ModelPack view).
    """
    index_path = Path(out_dir) / "image" / "index.json"
    try:
        manifests = json.loads(index_path.read_bytes()).get("manifests") or []
    except (OSError, ValueError, AttributeError) as e:
        raise ImageError(f"{index_path}: cannot read the image index: {e}") from e
    tags = {True: [], False: []}  # type: dict[bool, list[str | None]]
    for m in manifests:
        tags[m.get("artifactType") == ARTIFACT_TYPE].append((m.get("annotations") or {}).get(REF_NAME))
    images, views = tags[False], tags[True]
    if len(images) != 1 or not images[0] or len(views) > 1 or (views and not views[0]):
        raise ImageError(f"{index_path}: expected one tagged image and at most one ModelPack view, "
                         f"found {len(images)} and {len(views)}")
    return str(images[0]), (str(views[0]) if views else None)


def _copy(skopeo: str, src: str, dest: str, *, tls_verify: bool, timeout: float) -> str:
    with tempfile.TemporaryDirectory(prefix="packer-push-") as tmp:
        digest_file = Path(tmp) / "digest"
        cmd = [skopeo, "copy", "--quiet", "--preserve-digests", "--digestfile", str(digest_file),
               f"--dest-tls-verify={'true' if tls_verify else 'false'}", src, dest]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
        except subprocess.TimeoutExpired as e:
            raise ImageError(f"push to {dest}: skopeo timed out after {timeout:.0f} s") from e
        if proc.returncode != 0:
            msg = (proc.stderr.strip().splitlines() or ["no message"])[-1]
            raise ImageError(f"push to {dest}: skopeo failed: {msg}")
        return digest_file.read_text().strip()


def push(out_dir: Path, ref: str, *, tls_verify: bool = True, timeout: float = 3600) -> dict[str, str]:
    """Copy ``oci:OUT/image:TAG`` to ``docker://REF``, and the ModelPack view beside it.

    The manifests are pushed unchanged (``--preserve-digests``), so the registry's digests are
    the local ones; the ModelPack view goes to REF's tag with ``-modelpack`` appended
    (``repo:1.0`` -> ``repo:1.0-modelpack``) and shares the weight blobs already pushed.

    Args:
        out_dir: the packer output directory.
        ref: registry reference, ``host[:port]/repo[:tag]`` (a ``docker://`` prefix is optional).
        tls_verify: verify the registry's TLS certificate (False for a local test registry).
        timeout: seconds before one copy is abandoned.

    Returns:
        ``{reference pushed: manifest digest}``, the image first.

    Raises:
        ImageError: skopeo is not installed, or a copy failed (with skopeo's message).
    """
    image = Path(out_dir).resolve() / "image"
    tag, view = image_tags(out_dir)  # the input first
    skopeo = shutil.which("skopeo")
    if skopeo is None:
        raise ImageError("push: skopeo is not installed; install it (apt-get install skopeo) "
                         "or push OUT/image with another OCI tool")
    dest = ref.removeprefix("docker://")
    pushed = {dest: _copy(skopeo, f"oci:{image}:{tag}", f"docker://{dest}", tls_verify=tls_verify,
                          timeout=timeout)}
    if view is not None:
        view_dest = modelpack_tag(dest)
        pushed[view_dest] = _copy(skopeo, f"oci:{image}:{view}", f"docker://{view_dest}",
                                  tls_verify=tls_verify, timeout=timeout)
    return pushed
