"""The embedded captioned images load as documented: 45 records, uint8 RGB in the three sizes, the file's hash."""

from __future__ import annotations

import hashlib
from importlib import resources

import numpy

from packfree_plugin.cli.data import load_captioned_images

SHA256 = "3238f6aa6928b6e891b1bed652abcbad87a85321232301e31e0b9448380e5538"  # as the data README states


def test_captioned_images_load_with_their_text() -> None:
    images = load_captioned_images()
    assert len(images) == 45
    assert {image.pixels.shape for image in images} == {(56, 56, 3), (112, 56, 3), (112, 112, 3)}
    assert all(image.pixels.dtype == numpy.uint8 for image in images)
    assert all(image.question and image.answer.endswith(".") for image in images)
    assert len({image.name for image in images}) == 45
    assert [image.name for image in load_captioned_images(limit=2)] == [image.name for image in images[:2]]


def test_the_image_file_is_the_documented_one() -> None:
    data = resources.files("packfree_plugin.cli.data").joinpath("images.npz").read_bytes()
    assert hashlib.sha256(data).hexdigest() == SHA256
