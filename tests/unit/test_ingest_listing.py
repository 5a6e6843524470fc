"""The ingest's own walk of the source: every entry is a file to read (with its label) or skipped with a reason."""
import os

import pytest

from pipeline.lakehouse.source import SKIP_REASONS, label_rule, list_source

EXTS = [".png", ".jpg"]


def _touch(path, data=b"x"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return str(path)


def _by_path(listing):
    out = {p: ("read", label) for p, label, _ in listing.candidates}
    out.update({s.path: ("skipped", s.reason) for s in listing.skipped})
    assert len(out) == listing.files_found  # nothing counted twice
    return out


@pytest.mark.parametrize("depth, labels", [(1, ("cat", "cat", "dog")), (2, (None, "indoor", None)),
                                           (-1, ("cat", "indoor", "dog"))])
def test_label_depth(tmp_path, depth, labels):
    files = [_touch(tmp_path / "cat" / "a.png"), _touch(tmp_path / "cat" / "indoor" / "b.png"),
             _touch(tmp_path / "dog" / "c.png")]
    got = _by_path(list_source(str(tmp_path), EXTS, depth))
    for path, label in zip(files, labels):
        assert got[path] == (("read", label) if label else ("skipped", "no_label"))


def test_label_rule_says_which_folder():
    assert "folder 1 under the source" in label_rule(1) and "SOURCE/<label>/.../<file>" in label_rule(1)
    assert "SOURCE/*/<label>/" in label_rule(2)
    assert "folder 1 above the file" in label_rule(-1)


def test_every_entry_accounted_with_a_reason(tmp_path):
    src, outside = tmp_path / "src", tmp_path / "outside"
    good = _touch(src / "cat" / "a.png")
    paths = {
        _touch(src / "cat" / "zero.png", b""): "zero_byte",
        _touch(src / "cat" / "notes.txt"): "unsupported_extension",
        _touch(src / "cat" / "noext"): "unsupported_extension",
        _touch(src / "root.png"): "no_label",
        _touch(src / "cat" / "_x.png"): "hidden_name",
        _touch(src / "cat" / ".hidden.png"): "hidden_name",
        _touch(src / ".git" / "objects" / "ab"): "hidden_name",
        _touch(src / "_tmp" / "cat" / "a.png"): "hidden_name",
    }
    _touch(outside / "o.png")
    for name, target, reason in (("out.png", outside / "o.png", "symlink_outside"),
                                 ("gone.png", tmp_path / "nothing.png", "broken_symlink")):
        os.symlink(target, src / "cat" / name)
        paths[str(src / "cat" / name)] = reason
    os.symlink(outside, src / "linked_out")
    paths[str(src / "linked_out")] = "symlink_outside"
    os.symlink(src / "cat", src / "linked_in")
    paths[str(src / "linked_in")] = "symlinked_folder"
    os.mkfifo(src / "cat" / "fifo.png")
    with open(src / "cat" / "huge.png", "wb") as fh:  # sparse
        fh.truncate(2**31)
    paths[str(src / "cat" / "huge.png")] = "too_large"
    paths[str(src / "cat" / "fifo.png")] = "not_a_file"
    os.symlink(src / "cat" / "a.png", src / "cat" / "link_in.png")  # read: its content is deduplicated later

    listing = list_source(str(src), EXTS, 1)
    got = _by_path(listing)
    assert got == {good: ("read", "cat"), str(src / "cat" / "link_in.png"): ("read", "cat"),
                   **{p: ("skipped", r) for p, r in paths.items()}}
    assert listing.files_found == len(paths) + 2
    assert [c for c in listing.candidates if c[2]] == [(str(src / "cat" / "link_in.png"), "cat", True)]
    assert all(s.reason in SKIP_REASONS and s.detail for s in listing.skipped)
    assert [s.path for s in listing.skipped] == sorted(s.path for s in listing.skipped)
    detail = {s.path: s.detail for s in listing.skipped}
    assert ".txt is not one of ingest.extensions" in detail[str(src / "cat" / "notes.txt")]
    assert "outside" in detail[str(src / "cat" / "out.png")]


def test_unreadable_file_is_listed(tmp_path, monkeypatch):
    """As root every file is readable, so the permission check is exercised through os.access."""
    locked = _touch(tmp_path / "cat" / "locked.png")
    fine = _touch(tmp_path / "cat" / "fine.png")
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: p != locked and real_access(p, mode))
    got = _by_path(list_source(str(tmp_path), EXTS, 1))
    assert got == {locked: ("skipped", "unreadable"), fine: ("read", "cat")}


def test_ingest_keys_defaults_and_checks():
    from pipeline.config import ConfigError, load_config
    from pipeline.lakehouse.ingest import is_strict

    root = os.path.join(os.path.dirname(__file__), "..", "..", "conf", "base.yaml")
    cfg = load_config(root)
    assert (cfg.ingest.strict, cfg.ingest.label_depth, cfg.ingest.on_bad_file) == (False, 1, "skip")
    assert ".webp" in cfg.ingest.extensions and not is_strict(cfg)
    assert is_strict(load_config(root, ["ingest.strict=true"]))
    assert is_strict(load_config(root, ["ingest.on_bad_file=fail"]))  # the older switch, same meaning
    with pytest.raises(ConfigError, match="ingest.label_depth"):
        load_config(root, ["ingest.label_depth=0"])


def test_links_out_of_the_source_are_not_followed(tmp_path):
    """Two loop links, a link to / and links outside: the walk stays in the source and finishes at once."""
    import time

    src, outside = tmp_path / "src", tmp_path / "outside"
    a = _touch(src / "cat" / "a.png")
    _touch(outside / "o.png")
    os.symlink(src, src / "loop")  # back to the source root
    os.symlink(src / "cat", src / "cat" / "again")  # a second loop, one level down
    os.symlink("/", src / "cat" / "root")
    os.symlink(outside / "o.png", src / "cat" / "out.png")
    started = time.monotonic()
    got = _by_path(list_source(str(src), EXTS, 1))
    assert time.monotonic() - started < 30  # a followed loop would never end
    assert got == {a: ("read", "cat"), str(src / "loop"): ("skipped", "symlinked_folder"),
                   str(src / "cat" / "again"): ("skipped", "symlinked_folder"),
                   str(src / "cat" / "root"): ("skipped", "symlink_outside"),
                   str(src / "cat" / "out.png"): ("skipped", "symlink_outside")}


def test_walk_is_bounded_in_depth_and_size(tmp_path):
    from pipeline.lakehouse.ingest import IngestError

    deep = tmp_path / "deep"
    _touch(deep / "cat" / "b" / "c" / "d" / "e.png")
    assert len(list_source(str(deep), EXTS, 1, max_depth=4).candidates) == 1
    with pytest.raises(IngestError, match=r"folder .*/cat/b/c/d is 4 folders deep, more than the 3"):
        list_source(str(deep), EXTS, 1, max_depth=3)
    wide = tmp_path / "wide"
    for i in range(6):
        _touch(wide / "cat" / f"{i}.png")
    assert len(list_source(str(wide), EXTS, 1, max_entries=7).candidates) == 6  # 1 folder + 6 files
    with pytest.raises(IngestError, match=r"more than 6 files and folders \(the walk stopped in .*/wide/cat\)"):
        list_source(str(wide), EXTS, 1, max_entries=6)


def _sparse(path, size):
    """A file of `size` bytes that takes no disk or memory (a hole)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as fh:
        fh.truncate(size)
    return str(path)


def test_a_file_over_max_file_bytes_is_skipped_as_too_large_naming_it(tmp_path):
    """A 700 MB scan is never handed to Spark (each file is read whole into memory: it killed the JVM)."""
    small = _touch(tmp_path / "cat" / "a.png")
    scan = _sparse(tmp_path / "cat" / "scan.png", 700 * 2**20)
    at_bound = _sparse(tmp_path / "dog" / "edge.png", 256 * 2**20)
    listing = list_source(str(tmp_path), EXTS, 1, max_file_bytes=256 * 2**20)
    assert _by_path(listing) == {small: ("read", "cat"), scan: ("skipped", "too_large"), at_bound: ("read", "dog")}
    (s,) = listing.skipped
    assert f"{700 * 2**20} bytes" in s.detail and "ingest.max_file_mb" in s.detail and "256 MiB" in s.detail


def test_ingest_max_file_mb_bounds_the_listing_and_strict_names_the_file(tmp_path):
    """No Spark: a source whose only image is too large is refused before any read, naming it (strict) or counting
    it (not strict)."""
    from pipeline.config import ConfigError, load_config
    from pipeline.lakehouse.ingest import IngestError, ingest_folder

    root = os.path.join(os.path.dirname(__file__), "..", "..", "conf", "base.yaml")
    assert load_config(root).ingest.max_file_mb == 16
    for bad in ("0", "-1", "4096"):
        with pytest.raises(ConfigError, match="ingest.max_file_mb"):
            load_config(root, [f"ingest.max_file_mb={bad}"])
    scan = _sparse(tmp_path / "src" / "cat" / "scan.tif", 3 * 2**20)
    table = f"delta.table={tmp_path}/t"
    with pytest.raises(IngestError, match=r"nothing to ingest.*too_large=1"):
        ingest_folder(None, load_config(root, [table, "ingest.max_file_mb=2"]), str(tmp_path / "src"))
    with pytest.raises(IngestError) as err:
        ingest_folder(None, load_config(root, [table, "ingest.max_file_mb=2", "ingest.strict=true"]),
                      str(tmp_path / "src"))
    assert f"{scan} (too_large: {3 * 2**20} bytes" in str(err.value) and "nothing written" in str(err.value)
    assert not os.path.exists(tmp_path / "t")


def test_a_path_that_is_not_utf8_is_skipped_as_bad_name_with_its_bytes_shown(tmp_path):
    """Latin-1 names (an old zip): the file, and every file in such a folder, is skipped naming the real bytes, not
    handed to Spark as a mangled path that comes back not_read."""
    import json

    root = os.fsencode(tmp_path)
    good = _touch(tmp_path / "cat" / "ok.png")
    for rel in (b"cat/caf\xe9.png", b"d\xe9j\xe0/x.png"):
        os.makedirs(os.path.dirname(os.path.join(root, rel)), exist_ok=True)
        with open(os.path.join(root, rel), "wb") as fh:
            fh.write(b"x")
    listing = list_source(str(tmp_path), EXTS, 1)
    assert [c[0] for c in listing.candidates] == [good]
    got = {s.path: s for s in listing.skipped}
    assert set(got) == {f"{tmp_path}/cat/caf\\xe9.png", f"{tmp_path}/d\\xe9j\\xe0/x.png"}
    for s in got.values():
        assert s.reason == "bad_name" and "not valid UTF-8" in s.detail
        # no lone surrogate: a report, a log line and the Delta commit (a Rust string) can carry it
        assert json.dumps(s._asdict(), ensure_ascii=False).encode("utf-8").decode("utf-8").isprintable()
    assert "b'caf\\xe9.png'" in got[f"{tmp_path}/cat/caf\\xe9.png"].detail
    assert "b'd\\xe9j\\xe0'" in got[f"{tmp_path}/d\\xe9j\\xe0/x.png"].detail
    assert "bad_name" in SKIP_REASONS


def test_a_bad_name_fails_a_strict_ingest_naming_it(tmp_path):
    from pipeline.config import load_config
    from pipeline.lakehouse.ingest import IngestError, ingest_folder

    os.makedirs(tmp_path / "src" / "cat")
    with open(os.path.join(os.fsencode(tmp_path / "src" / "cat"), b"na\xefve.png"), "wb") as fh:
        fh.write(b"x")
    root = os.path.join(os.path.dirname(__file__), "..", "..", "conf", "base.yaml")
    cfg = load_config(root, [f"delta.table={tmp_path}/t", "ingest.strict=true"])
    with pytest.raises(IngestError) as err:
        ingest_folder(None, cfg, str(tmp_path / "src"))
    assert f"{tmp_path}/src/cat/na\\xefve.png (bad_name: b'na\\xefve.png' is not valid UTF-8" in str(err.value)
