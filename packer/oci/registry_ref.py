"""A registry reference as ``packer push`` takes it: ``host[:port]/repository[:tag][@digest]``.

The grammar is the distribution project's (``reference/regexp.go``), with the registry host
required: a bare ``name:tag`` would go to Docker Hub, which nobody pushing a build means by
accident. Anything else is refused before skopeo sees it, so a REF cannot name another of
skopeo's transports (``dir:``, ``oci:``, ``docker-daemon:``, ``containers-storage:``), pass for
an option (``-x``) or carry whitespace and control characters into a command line or a log.
"""

from __future__ import annotations

from packer.errors import UsageError
from packer.runtime.registry import MAX_NAME, REF  # the one grammar: the streamed load reads it too
from packer.util.idents import shown


def check_ref(ref: str) -> str:
    """``ref`` without its optional ``docker://`` prefix, if it is a registry reference.

    Args:
        ref: ``[docker://]host[:port]/repository[:tag][@digest]``; the host is a domain name
            with a dot, ``localhost``, an IP address, or any name with a port.

    Returns:
        The reference as skopeo's ``docker://`` transport takes it (the prefix removed).

    Raises:
        UsageError: anything else (exit code 2), with what a REF looks like.
    """
    dest = ref.removeprefix("docker://")
    m = REF.fullmatch(dest)
    domain = m.group("domain") if m else ""
    has_host = "." in domain or ":" in domain or domain == "localhost"
    if m is None or not has_host:
        raise UsageError(f"push: REF {shown(ref)} is not a registry reference; expected "
                         "host[:port]/repository[:tag], e.g. registry.example.com/team/model:1.0")
    name = f"{domain}/{m.group('path')}"
    if len(name) > MAX_NAME:
        raise UsageError(f"push: REF {shown(ref)}: the repository name is longer than {MAX_NAME} characters")
    return dest
