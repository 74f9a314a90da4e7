"""Image validation, the image store and image references."""

import hashlib
import os

import pytest
from PIL import Image

from tide_megatron.envs.config import ImageLimits
from tide_megatron.envs.image_store import ImageStore
from tide_megatron.envs.images import (
    ImageError, check_against_ref, decode_image, encode_image, read_image_file, sniff_format, validate_image,
)
from tide_megatron.envs.protocol import ImageRef, ResetResult, StepResult


def picture(w=64, h=48, fmt="png"):
    img = Image.new("RGB", (w, h), (30, 60, 90))
    for x in range(0, w, 4):
        img.putpixel((x, x % h), (250, 10, 10))
    return encode_image(img, fmt)


@pytest.mark.parametrize("fmt", ["png", "jpeg"])
def test_good_images_validate_with_their_size_and_digest(fmt):
    data = picture(fmt=fmt)
    info = validate_image(data, ImageLimits())
    assert (info.format, info.width, info.height, info.nbytes) == (fmt, 64, 48, len(data))
    assert info.sha256 == hashlib.sha256(data).hexdigest()
    assert decode_image(data).size == (64, 48) and decode_image(data).mode == "RGB"


@pytest.mark.parametrize("fmt, cut", [("png", 10), ("png", 200), ("jpeg", 2), ("jpeg", 300)])
def test_truncated_images_are_refused(fmt, cut):
    data = picture(fmt=fmt)
    with pytest.raises(ImageError, match="truncated"):
        validate_image(data[: len(data) - cut], ImageLimits())


def test_corrupt_payload_with_valid_framing_is_refused():
    data = bytearray(picture())
    data[60:90] = b"\x00" * 30  # inside the IDAT stream: framing intact, pixels undecodable
    with pytest.raises(ImageError, match="undecodable png"):
        validate_image(bytes(data), ImageLimits())


@pytest.mark.parametrize("data, match", [
    (b"", "empty"),
    (b"GIF89a" + b"\x00" * 40, "not a PNG or JPEG"),
    (b"<html>502 Bad Gateway</html>", "not a PNG or JPEG"),
    (b"\x89PNX\r\n\x1a\n" + b"\x00" * 40, "not a PNG or JPEG"),
])
def test_wrong_magic_is_refused(data, match):
    with pytest.raises(ImageError, match=match):
        validate_image(data, ImageLimits())


def test_size_limits():
    data = picture(64, 48)
    with pytest.raises(ImageError, match="max_bytes"):
        validate_image(data, ImageLimits(max_bytes=len(data) - 1))
    with pytest.raises(ImageError, match="max_width"):
        validate_image(data, ImageLimits(max_width=63))
    with pytest.raises(ImageError, match="max_width x max_height"):
        validate_image(data, ImageLimits(max_height=47))
    with pytest.raises(ImageError, match="max_pixels"):
        validate_image(data, ImageLimits(max_pixels=64 * 48 - 1))
    with pytest.raises(ImageError, match="not accepted"):
        validate_image(picture(fmt="jpeg"), ImageLimits(formats=["png"]))
    assert validate_image(data, ImageLimits(max_bytes=len(data), max_width=64, max_height=48, max_pixels=64 * 48))


def test_decompression_bomb_is_refused_from_its_header():
    # A 20000 x 20000 single-colour PNG compresses to a few hundred KB; its header alone condemns it.
    bomb = encode_image(Image.new("1", (20000, 20000)))
    assert len(bomb) < 1_000_000
    with pytest.raises(ImageError, match="max_width"):
        validate_image(bomb, ImageLimits())


def test_sniff_format():
    assert sniff_format(picture()) == "png" and sniff_format(picture(fmt="jpeg")) == "jpeg"
    assert sniff_format(b"\xff\xd8") is None


def test_image_ref_round_trip_and_validation():
    data = picture()
    info = validate_image(data, ImageLimits())
    ref = ImageRef("abc_-1", "/x/abc.png", "png", 64, 48, info.sha256, len(data))
    assert ImageRef.from_json(ref.to_json()) == ref
    for bad in [{"id": "../etc"}, {"format": "gif"}, {"sha256": "XYZ"}, {"width": 0}, {"nbytes": True}]:
        with pytest.raises(ValueError):
            ImageRef.from_json({**ref.to_json(), **bad})
    step = StepResult("o", 0.5, False, {}, images=[ref], image_data=[data])
    wire = step.to_json()
    assert "image_data" not in wire and wire["images"] == [ref.to_json()]
    assert StepResult.from_json(wire) == step and StepResult.from_json(wire).image_data == []
    # A reply without `images` (a server that predates them) means no images.
    legacy = ResetResult("o", {}, "t", 0.0, "s1").to_json()
    del legacy["images"]
    assert ResetResult.from_json(legacy).images == []


def test_store_keeps_the_newest_images_per_session_and_cleans_up(tmp_path):
    store = ImageStore(str(tmp_path), keep_per_session=2)
    limits = ImageLimits()
    imgs = [picture(10 + i, 10) for i in range(3)]
    refs = [store.put("s1", d, validate_image(d, limits)) for d in imgs]
    other = store.put("s2", imgs[0], validate_image(imgs[0], limits))
    assert len({r.id for r in refs}) == 3 and all(os.path.dirname(r.path) == store.dir for r in refs)
    assert not os.path.exists(refs[0].path)  # evicted: only the newest 2 are kept
    assert read_image_file(refs[2], limits) == imgs[2]
    assert store.read("s1", refs[1].id) == (refs[1], imgs[1])
    with pytest.raises(KeyError):
        store.read("s2", refs[1].id)  # another session's image
    with pytest.raises(KeyError):
        store.read("s1", refs[0].id)  # evicted
    assert os.stat(store.dir).st_mode & 0o077 == 0 and os.stat(refs[2].path).st_mode & 0o077 == 0
    store.release("s1")
    assert not os.path.exists(refs[1].path) and not os.path.exists(refs[2].path) and store.count() == 1
    store.close()
    assert not os.path.exists(other.path) and not os.path.exists(store.dir)


def test_store_removes_directories_of_dead_servers(tmp_path):
    dead = tmp_path / "tide-env-images-999999999-abc"
    dead.mkdir()
    (dead / "x.png").write_bytes(b"x")
    alive = tmp_path / f"tide-env-images-{os.getppid()}-abc"
    alive.mkdir()
    store = ImageStore(str(tmp_path))
    assert not dead.exists() and alive.exists()
    store.close()


def test_reading_back_checks_the_reference(tmp_path):
    limits = ImageLimits()
    data = picture()
    store = ImageStore(str(tmp_path))
    ref = store.put("s", data, validate_image(data, limits))
    with open(ref.path, "r+b") as f:  # same size, different bytes
        f.seek(len(data) - 20)
        f.write(b"\x00")
    with pytest.raises(ImageError):
        read_image_file(ref, limits)
    other = picture(64, 48, "jpeg")
    with pytest.raises(ImageError, match="reference says"):
        check_against_ref(other, ref, limits)
    fifo = tmp_path / "fifo.png"
    os.mkfifo(fifo)
    with pytest.raises(ImageError, match="not a regular file"):
        read_image_file(ImageRef("f", str(fifo), "png", 1, 1, "0" * 64, 1), limits)
    link = tmp_path / "link.png"
    link.symlink_to(ref.path)
    with pytest.raises(ImageError, match="cannot open"):
        read_image_file(ImageRef("l", str(link), "png", 1, 1, "0" * 64, 1), limits)
    with pytest.raises(ImageError, match="cannot open"):
        read_image_file(ImageRef("m", str(tmp_path / "missing.png"), "png", 1, 1, "0" * 64, 1), limits)
    store.close()
