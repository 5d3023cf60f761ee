"""What the shards stage prints and logs about the private shards: which could not be read, how many
were, and the size of an image, are the data owner's to know (invariant 16, pipeline/privacy/README.md):
listed in `.dpfm/owner/shards.log`, never printed."""

from __future__ import annotations

import re
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
from shard_data import good, index, raw_tar


def test_unreadable_shards_are_skipped_and_counted(tmp_path, capsys):
    rng = np.random.default_rng(5)
    raw_tar(tmp_path / "ok.tar", good("a", rng))
    (tmp_path / "junk.tar").write_bytes(b"\x01" * 4000)
    raw_tar(tmp_path / "t.tar", good("x", rng) + good("y", rng))
    data = (tmp_path / "t.tar").read_bytes()
    (tmp_path / "cut.tar").write_bytes(data[:data.index(b"y.jpg")])  # damaged: a clean cut before y
    stats, ds = index([tmp_path / f"{n}.tar" for n in ("ok", "missing", "junk", "cut")], tmp_path)
    assert len(ds) == 2
    # Each row reads its own shard, whichever were skipped before it: x is in cut.tar, listed fourth.
    with tarfile.open(tmp_path / "t.tar") as t:
        assert [ds.key(i) for i in range(2)] == ["a", "x"] and ds.read_member(1, "jpg") == t.extractfile("x.jpg").read()
    skipped = {s["url"].rsplit("/", 1)[1]: s["error"] for s in stats["shards"]["skipped"]}
    assert set(skipped) == {"missing.tar", "junk.tar"}
    assert "FileNotFoundError" in skipped["missing.tar"] and "not a tar" in skipped["junk.tar"]
    # Which shards of the private data are unreadable or damaged, and how many, is the owner's to know:
    # listed in the owner's log, neither printed nor counted in the progress bar.
    log = tmp_path / ".dpfm/owner/shards.log"
    assert log.stat().st_mode & 0o077 == 0
    assert all(name in log.read_text() for name in ("missing.tar", "junk.tar", "cut.tar"))
    printed = "".join(capsys.readouterr())
    assert not [name for name in ("missing", "junk", "cut.tar", "skipped=") if name in printed], printed


def test_what_a_scan_prints_does_not_depend_on_which_shards_are_readable_or_how_long_they_took(
        tmp_path, capsys, monkeypatch, progress_clock):
    """Measured: two sources of four listed shards, one with every shard readable and one with two
    junk, each shard's scan taking time by its content (a readable shard decodes its images, seconds
    at scale; a junk one fails at once). Built twice each, as the shards stage runs after its scan jobs
    (every readable shard then cached, an unreadable one never), what is printed (the progress bar
    included) is the same text: the share done, no count, no time, and no redraw that the clock decides.
    It fails with tqdm's own bar, whose elapsed time, rate and redraws follow the slow shards."""
    from pipeline.data import index as index_module

    scan_one = index_module._scan_cached

    def timed_scan(job):
        piece, info = scan_one(job)
        progress_clock.advance(0.01 if "error" in info else 7.0)
        return piece, info

    monkeypatch.setattr(index_module, "_scan_cached", timed_scan)
    rng = np.random.default_rng(6)
    printed = {}
    for junk in (0, 2):
        root = tmp_path / f"junk{junk}"
        root.mkdir()
        for i in range(4):
            if i < junk:
                (root / f"s{i}.tar").write_bytes(b"\x01" * 4000)
            else:
                raw_tar(root / f"s{i}.tar", good(f"k{i}", rng))
        urls = [root / f"s{i}.tar" for i in range(4)]
        index(urls, root)
        first = "".join(capsys.readouterr()).replace(str(root), "ROOT")
        index(urls, root, name="again", cache="out")  # the same cache: the gather after the scan jobs
        printed[junk] = first, "".join(capsys.readouterr()).replace(str(root), "ROOT")
        assert "2 of 4" in (root / ".dpfm/owner/shards.log").read_text() or not junk
    assert printed[0] == printed[2], printed
    # The share done, never a count: a downloaded list's length would say how many of its rows failed.
    assert "100%" in printed[0][0] and not re.search(r"\d\d:\d\d|/s\b|\d/\d", "".join(printed[0])), printed[0]


# Run as its own process, so that what is printed is what a stage prints under Python's own warning
# filters (pytest records warnings instead). Pillow's limit is lowered so a 48x48 picture (2,304
# pixels) sits between it and twice it, where Pillow warns with the exact count instead of raising;
# a palette PNG with byte transparency makes Pillow warn of that image's format.
DECOMPRESSION_BOMB = """
import io, sys
from pathlib import Path
import numpy as np
from PIL import Image
sys.path.insert(0, sys.argv[2])
from shard_data import good, index, raw_tar
from pipeline.data.loader import _Decoded
from pipeline.data.transforms import encode_jpeg
Image.MAX_IMAGE_PIXELS = 2000
root = Path(sys.argv[1])
rng = np.random.default_rng(0)
big = [("big.jpg", encode_jpeg(rng.integers(0, 256, (48, 48, 3), dtype=np.uint8))), ("big.txt", b"a photo")]
palette = Image.fromarray(rng.integers(0, 4, (20, 20), dtype=np.uint8), mode="P")
palette.putpalette([0, 0, 0, 255, 0, 0, 0, 255, 0, 0, 0, 255])
png = io.BytesIO()
palette.save(png, format="PNG", transparency=bytes([0, 255, 128, 255]))
raw_tar(root / "s.tar", good("small", rng) + big + [("pal.png", png.getvalue()), ("pal.txt", b"a drawing")])
stats, ds = index([root / "s.tar"], root)  # the scan decodes every image
indices, images, _ = _Decoded(ds, 16, captions=True)[list(range(len(ds)))]  # training's decode
assert len(ds) == 3 and images.shape == (3, 16, 16, 3), (len(ds), images.shape)
print("decoded")
"""


def test_a_private_image_near_the_decompression_bomb_limit_is_decoded_without_its_pixel_count(tmp_path):
    done = subprocess.run([sys.executable, "-c", DECOMPRESSION_BOMB, str(tmp_path), str(Path(__file__).parent)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "decoded" in done.stdout, done.stderr[-2000:]
    assert "2304" not in done.stdout + done.stderr and "pixels" not in done.stderr, done.stderr[-2000:]
    assert "Palette" not in done.stderr and "Warning" not in done.stderr, done.stderr[-2000:]
