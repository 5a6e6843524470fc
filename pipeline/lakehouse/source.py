"""The ingest source folder: walked without following links, every entry a file to read or a skipped file with its
reason, within bounds; executors then read exactly the listed files, re-checked at read time."""
from __future__ import annotations

import os
import stat
from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, List, NamedTuple, Sequence, Tuple

# Why a file under the source was not ingested: every file is either a row or one of these, with its path.
SKIP_REASONS = {
    "hidden_name": "its name, or a folder's on its path, starts with '_' or '.' (metadata by convention; "
                   "Spark and Hadoop skip these)",
    "symlink_outside": "a symbolic link to something outside the source",
    "broken_symlink": "a symbolic link whose target does not exist",
    "symlinked_folder": "a symbolic link to a folder inside the source (its files are accounted at their own paths)",
    "not_a_file": "not a regular file (a FIFO, socket or device)",
    "unsupported_extension": "its extension is not in ingest.extensions",
    "zero_byte": "an empty file",
    "too_large": "larger than ingest.max_file_mb (a file is read whole into one binary cell, at most 2 GiB)",
    "unreadable": "it cannot be opened or listed (permissions, or it vanished)",
    "bad_name": "its path is not valid UTF-8 (e.g. Latin-1 names from an old zip), which Spark cannot carry; the "
                "report shows those bytes as \\xNN",
    "no_label": "too few folders between the source and the file to give a label (ingest.label_depth)",
    "undecodable": "not an image that Pillow can decode",
    "duplicate": "the same bytes (SHA-256) as a file that was ingested",
    "not_read": "listed by the walk but not read: it vanished, changed kind, or now leads outside the source",
    "already_in_table": "the same bytes (SHA-256) as a row already in the table (a re-run or a retried job)",
}
MAX_BINARY_FILE = 2**31 - 1  # the most one binary cell holds; ingest.max_file_mb bounds a file further
# Bounds of the walk: a source deeper or larger than this is refused (naming where) rather than read for hours.
MAX_SOURCE_DEPTH = 64  # folders below the source
MAX_SOURCE_ENTRIES = 5_000_000  # files and folders

class IngestError(RuntimeError):
    """The ingest cannot proceed; nothing was written."""


class SkippedFile(NamedTuple):
    path: str
    reason: str  # a key of SKIP_REASONS
    detail: str


@dataclass
class SourceListing:
    """What a walk of the source found: the files to read with their labels, and those skipped before reading."""

    root: str
    candidates: List[Tuple[str, str, bool]] = field(default_factory=list)  # (path, label, is_symlink)
    skipped: List[SkippedFile] = field(default_factory=list)
    candidate_bytes: int = 0  # the candidates' total size

    @property
    def files_found(self) -> int:
        return len(self.candidates) + len(self.skipped)


def skipped_counts(skipped: Sequence[SkippedFile]) -> Dict[str, int]:
    """{reason: number of files}, in the order of SKIP_REASONS."""
    counts = Counter(s.reason for s in skipped)
    return {r: counts[r] for r in SKIP_REASONS if counts[r]}



def label_rule(depth: int) -> str:
    """The label rule of `ingest.label_depth`, in words (logged and recorded with the commit)."""
    if depth > 0:
        shape = "/".join(["SOURCE"] + ["*"] * (depth - 1) + ["<label>", "...", "<file>"])
        return f"the label is folder {depth} under the source ({shape}; ingest.label_depth={depth})"
    shape = "/".join(["SOURCE", "...", "<label>"] + ["*"] * (-depth - 1) + ["<file>"])
    return f"the label is folder {-depth} above the file ({shape}; ingest.label_depth={depth})"


def hidden_name(name: str) -> bool:
    return name.startswith("_") or name.startswith(".")


def inside(path: str, real_root: str) -> bool:
    return os.path.commonpath([path, real_root]) == real_root


def valid_utf8(path: str) -> bool:
    """Whether a path from the walk is valid UTF-8: bytes that are not come back from os.walk as lone surrogates
    (surrogateescape), which no JSON, Spark string or Delta log can carry."""
    try:
        path.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def printable(text: str) -> str:
    """`text` (a path, or a detail naming one) with the bytes of a name that is not valid UTF-8 shown as \\xNN
    (`caf\\xe9.png`), valid UTF-8 kept as it is: what a report, a log line and the Delta commit can carry."""
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # a surrogate no walk gives
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


def list_source(root: str, extensions: Sequence[str], label_depth: int, max_depth: int = MAX_SOURCE_DEPTH,
                max_entries: int = MAX_SOURCE_ENTRIES, max_file_bytes: int = MAX_BINARY_FILE) -> SourceListing:
    """Walk `root` (symbolic links not followed) and sort every entry into a file to read or a skipped file.

    This listing is the whole of what the ingest reads: Spark is handed these paths, never the folder, so a link
    to a folder (a loop, `/`) is not followed and a link to a file outside the source is skipped
    (`symlink_outside`), never read. A file larger than `max_file_bytes` (ingest.max_file_mb; at most 2 GiB) is
    skipped (`too_large`), never read into memory; a path that is not valid UTF-8 is skipped (`bad_name`) and
    reported with its bytes shown as \\xNN. A tree deeper than `max_depth` folders or with more than `max_entries`
    files and folders raises IngestError naming where the walk stopped.
    """
    root = os.path.abspath(root)
    real_root = os.path.realpath(root)
    exts = tuple(e.lower() for e in extensions)
    max_file_bytes = min(int(max_file_bytes), MAX_BINARY_FILE)
    out = SourceListing(root=root)

    def skip(path: str, reason: str, detail: str) -> None:
        out.skipped.append(SkippedFile(printable(path), reason, printable(detail)))

    def unlistable(exc: OSError) -> None:
        skip(exc.filename or root, "unreadable", f"folder cannot be listed: {exc.strerror or exc}")

    entries = 0
    for dirpath, dirnames, filenames in os.walk(root, onerror=unlistable):  # followlinks=False
        dirnames.sort()
        rel_dir = os.path.relpath(dirpath, root)
        folders = [] if rel_dir == "." else rel_dir.split(os.sep)
        if len(folders) > max_depth:
            raise IngestError(f"ingest source {root}: folder {dirpath} is {len(folders)} folders deep, more than "
                              f"the {max_depth} the walk goes; nothing written")
        entries += len(dirnames) + len(filenames)
        if entries > max_entries:
            raise IngestError(f"ingest source {root} holds more than {max_entries} files and folders (the walk "
                              f"stopped in {dirpath}); ingest it in parts; nothing written")
        for name in dirnames:
            full = os.path.join(dirpath, name)
            if not os.path.islink(full):
                continue
            target = os.path.realpath(full)
            if not os.path.exists(full):
                skip(full, "broken_symlink", f"symbolic link to missing {os.readlink(full)}")
            elif not inside(target, real_root):
                skip(full, "symlink_outside", f"symbolic link to folder {target}, outside {real_root}")
            else:
                skip(full, "symlinked_folder", f"symbolic link to folder {target}, not followed")
        for name in sorted(filenames):
            full = os.path.join(dirpath, name)
            if not valid_utf8(full):
                bad = next((p for p in folders + [name] if not valid_utf8(p)), root)
                skip(full, "bad_name", f"{os.fsencode(bad)!r} is not valid UTF-8 (a Latin-1 name?); rename it "
                                       f"(e.g. convmv -f latin1 -t utf8) to ingest the file")
                continue
            hidden = [p for p in folders + [name] if hidden_name(p)]
            is_link = os.path.islink(full)
            if is_link:
                target = os.path.realpath(full)
                if not os.path.exists(full):
                    skip(full, "broken_symlink", f"symbolic link to missing {os.readlink(full)}")
                    continue
                if not inside(target, real_root):
                    skip(full, "symlink_outside", f"symbolic link to {target}, outside {real_root}")
                    continue
            if hidden:
                skip(full, "hidden_name", f"'{hidden[0]}' starts with '{hidden[0][0]}'")
                continue
            try:
                st = os.stat(full)
            except OSError as exc:
                skip(full, "unreadable", f"cannot stat: {exc.strerror or exc}")
                continue
            if not stat.S_ISREG(st.st_mode):
                skip(full, "not_a_file", "not a regular file")
                continue
            if not name.lower().endswith(exts):
                ext = os.path.splitext(name)[1] or "(no extension)"
                skip(full, "unsupported_extension", f"{ext} is not one of ingest.extensions ({', '.join(exts)})")
                continue
            if st.st_size == 0:
                skip(full, "zero_byte", "0 bytes")
                continue
            if st.st_size > max_file_bytes:
                skip(full, "too_large", f"{st.st_size} bytes, more than the {max_file_bytes} bytes "
                                        f"({max_file_bytes / 2**20:g} MiB) of ingest.max_file_mb (raise it with "
                                        f"Spark's memory)")
                continue
            if not os.access(full, os.R_OK):
                skip(full, "unreadable", "no read permission")
                continue
            if len(folders) < abs(label_depth):
                skip(full, "no_label", f"{len(folders)} folder(s) between the source and the file; "
                                       f"ingest.label_depth={label_depth} needs {abs(label_depth)}")
                continue
            label = folders[label_depth - 1] if label_depth > 0 else folders[label_depth]
            out.candidates.append((full, label, is_link))
            out.candidate_bytes += st.st_size
    out.skipped.sort(key=lambda s: s.path)
    return out



def read_udf(real_root: str, max_file_bytes: int = MAX_BINARY_FILE):
    """Executors read exactly the listed files, re-checking each at read time: still a regular file, still
    inside the source (a file swapped for a link, or a link re-pointed, since the walk is not read), still
    within `max_file_bytes` (a file that grew since the walk is not read into memory)."""
    max_file_bytes = min(int(max_file_bytes), MAX_BINARY_FILE)
    from pyspark.sql.functions import udf

    def read(path: str, is_link: bool):
        real = os.path.realpath(path)
        if not inside(real, real_root):
            return None, f"now resolves to {real}, outside {real_root}"
        try:
            # O_NONBLOCK: a file replaced by a FIFO since the walk must not block the read
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | (0 if is_link else os.O_NOFOLLOW))
        except OSError as exc:
            return None, f"cannot be opened: {exc.strerror or exc}"
        with os.fdopen(fd, "rb") as fh:
            st = os.fstat(fh.fileno())
            if not stat.S_ISREG(st.st_mode):
                return None, "no longer a regular file"
            if st.st_size > max_file_bytes:
                return None, f"now {st.st_size} bytes, more than the {max_file_bytes} of ingest.max_file_mb"
            try:
                return fh.read(), None
            except OSError as exc:
                return None, f"cannot be read: {exc.strerror or exc}"

    # nondeterministic: Spark must read each file once, not once per column that uses its bytes
    return udf(read, "content binary, error string").asNondeterministic()
