"""Which image features a prefill chunk takes, and where they go in a packed step."""

from __future__ import annotations

import torch

from gpu_worker.scheduler import ScheduledSeq
from gpu_worker.sequence import SamplingParams, Sequence
from gpu_worker.step_inputs import ImageRows, build_step_inputs
from gpu_worker.vision.images import PromptImages, image_token_runs
from kernels import NO_SLOT

IMG = 99
# The module docstring's example: two 4-token images at positions 2-5 and 8-11.
IDS = [1, 7, IMG, IMG, IMG, IMG, 7, 7, IMG, IMG, IMG, IMG, 7]


def _images() -> PromptImages:
    return PromptImages(torch.zeros(2, 3, 4, 4), image_token_runs(IDS, IMG), ("a" * 64, "b" * 64))


def test_runs_of_image_tokens():
    assert image_token_runs(IDS, IMG) == ((2, 4), (8, 4))
    assert image_token_runs([IMG, IMG, 7, IMG], IMG) == ((0, 2), (3, 1))
    assert image_token_runs([7, 7], IMG) == ()


def test_a_chunk_takes_its_slice_of_the_features():
    images = _images()
    assert (images.num_tokens, images.end) == (8, 12)
    assert list(images.rows_in(5, 10)) == [(5, 3, 1), (8, 4, 2)]
    assert list(images.rows_in(0, 2)) == [] and list(images.rows_in(12, 13)) == []


def test_chunks_cover_every_feature_once():
    images = _images()
    for size in range(1, len(IDS) + 1):
        taken = [(position + i, feature + i) for start in range(0, len(IDS), size)
                 for position, feature, count in images.rows_in(start, min(start + size, len(IDS)))
                 for i in range(count)]
        assert taken == list(zip([2, 3, 4, 5, 8, 9, 10, 11], range(8))), size


def _seq(request_id: str, ids: list[int], images: PromptImages | None, num_cached: int, slot: int) -> Sequence:
    seq = Sequence(request_id, ids, SamplingParams(), None, None, images)  # no detokenizer: never sampled here
    seq.num_cached, seq.slot, seq.block_table = num_cached, slot, [1, 2]
    return seq


def test_step_inputs_place_image_rows_in_the_packed_batch():
    """A base-model text sequence is packed first (sorted by slot), then positions 5..9 of the image
    prompt: its image tokens 5, 8, 9 land in packed rows 3, 6, 7."""
    text = _seq("text", [7, 7, 7], None, 0, slot=NO_SLOT)
    image = _seq("image", IDS, _images(), 5, slot=0)
    inputs = build_step_inputs([ScheduledSeq(image, 5, False), ScheduledSeq(text, 3, True)], block_size=16)
    assert [item.seq.request_id for item in inputs.items] == ["text", "image"]
    assert inputs.image_rows == [ImageRows(image, 3, 3, 1), ImageRows(image, 6, 4, 2)]
    assert not inputs.is_decode_only
