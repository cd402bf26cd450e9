"""A folder taken out of one sandbox for another, with nothing in it that reaches outside it.

A separate grader's sandbox receives what the policy left as a tar archive of each declared path (a Harbor task's
``artifacts``). The policy wrote that archive's every byte, and the grader extracts it as root into a sandbox that
holds the hidden tests, so ``confine`` rebuilds it on the host keeping only what stays inside the declared path by
construction: folders, regular files, and links whose target, read as a path from the link's own folder, is inside
the path too. Everything else is dropped and named: absolute links and links that climb out (a link to
``/tests/expected.txt`` would hand the grader's own answer back to it), hard links, devices, FIFOs, members outside
the path, and members beneath a link (which extraction would write through). Modes lose setuid, setgid and sticky
bits; owners stay numeric, as Docker's own copy keeps them.
"""

from __future__ import annotations

import io
import posixpath
import tarfile
from dataclasses import dataclass, field


@dataclass
class Confined:
    """``confine``'s result: the rebuilt archive (empty bytes: nothing was there), how many members it kept, and the
    names of the members dropped, with why."""

    archive: bytes
    kept: int = 0
    dropped: list[str] = field(default_factory=list)


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def confine(archive: bytes, root: str, max_members: int = 200_000) -> Confined:
    """``archive`` (a tar of ``root``, an absolute path, with member names relative to ``/``) rebuilt with only what
    stays inside ``root`` (see the module). Raises ValueError for bytes that are not a tar archive."""
    root = posixpath.normpath("/" + root.lstrip("/"))
    out = io.BytesIO()
    kept, dropped, links = 0, [], set()
    try:
        source = tarfile.open(fileobj=io.BytesIO(archive), mode="r:")
    except tarfile.TarError as e:
        raise ValueError(f"not a tar archive: {e}") from None
    with source, tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as target:
        for n, member in enumerate(source):
            if n >= max_members:
                dropped.append(f"... (more than {max_members} members)")
                break
            path = posixpath.normpath("/" + member.name.lstrip("/"))
            why = _refusal(member, path, root, links)
            if why:
                dropped.append(f"{path} ({why})")
                continue
            clean = member.replace(name=path.lstrip("/") or ".", mode=member.mode & 0o777, deep=False)
            clean.pax_headers = {}  # nothing of the policy's beyond name, mode, owner, time, size and link
            if member.issym():
                links.add(path)
                target.addfile(clean)
            elif member.isdir():
                target.addfile(clean)
            else:
                target.addfile(clean, source.extractfile(member))
            kept += 1
    return Confined(out.getvalue() if kept else b"", kept, dropped)


def _refusal(member: tarfile.TarInfo, path: str, root: str, links: set[str]) -> str:
    """Why ``member`` (at ``path``) may not be extracted into a grader's sandbox; "" when it may."""
    if not _inside(path, root) or ".." in member.name.split("/"):
        return "outside the artifact"
    parent = posixpath.dirname(path)
    while _inside(parent, root):
        if parent in links:
            return "beneath a link"
        if parent == root:
            break
        parent = posixpath.dirname(parent)
    if member.issym():
        if member.linkname.startswith("/"):
            return f"a link to {member.linkname}: absolute"
        if not _inside(posixpath.normpath(posixpath.join(posixpath.dirname(path), member.linkname)), root):
            return f"a link to {member.linkname}: outside the artifact"
        return ""
    if member.islnk():
        return "a hard link"
    if not (member.isdir() or member.isreg()):
        return "not a file, folder or link"
    return ""
