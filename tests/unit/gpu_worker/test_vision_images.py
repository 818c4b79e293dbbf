"""Which image features a prefill chunk takes, and where they go in a packed step (with M-RoPE positions)."""

from __future__ import annotations

import torch

from gpu_worker.scheduler import ScheduledSeq
from gpu_worker.sequence import SamplingParams, Sequence
from gpu_worker.step_inputs import ImageRows, build_step_inputs
from gpu_worker.vision.images import PromptImages, fixed_size_images, grid_images, image_token_runs
from kernels import NO_SLOT

IMG = 99
# The module docstring's example: two 4-token images at positions 2-5 and 8-11.
IDS = [1, 7, IMG, IMG, IMG, IMG, 7, 7, IMG, IMG, IMG, IMG, 7]


def _images() -> PromptImages:
    return fixed_size_images(torch.zeros(2, 3, 4, 4), image_token_runs(IDS, {IMG}), ("a" * 64, "b" * 64))


def _grid_images() -> PromptImages:
    """The same token layout as two Qwen2-VL images of 2 x 4 and 4 x 2 patches (1 x 2 and 2 x 1 merged)."""
    pixels = torch.arange(16.0)[:, None].expand(16, 6)
    visuals = [(pixels[:8], (1, 2, 4)), (pixels[8:], (1, 4, 2))]
    return grid_images(len(IDS), visuals, ((2, 2), (8, 2)), ("a", "b"), 2)


def test_runs_of_image_tokens():
    assert image_token_runs(IDS, {IMG}) == ((2, 4), (8, 4))
    assert image_token_runs([IMG, IMG, 7, IMG], {IMG}) == ((0, 2), (3, 1))
    assert image_token_runs([7, 7], {IMG}) == ()


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


def test_images_of_different_sizes_have_their_own_features():
    ids = [1, IMG, IMG, 7, IMG, IMG, IMG, IMG, IMG, 7]
    images = PromptImages((torch.zeros(3), torch.zeros(5)), image_token_runs(ids, {IMG}), ("a", "b"), (2, 5))
    assert images.content_in(2, 6) == ((2, "a", 1), (4, "b", 0), (5, "b", 1))


def test_grid_images_split_patches_and_position_tokens_in_3d():
    ids = [1, 7, IMG, IMG, 7, 7, 7, 7, IMG, IMG, 7, 7, 7]
    images = _grid_images()
    assert [p[:, 0].tolist() for p in images.pixel_values] == [list(range(8)), list(range(8, 16))]
    assert images.image_tokens == (2, 2) and images.grids == ((1, 2, 4), (1, 4, 2))
    # image 1: (2, 2, 2), (2, 2, 3); its text continues at 2 + max(1, 2) = 4; image 2 at 8: rows 8, 9
    assert images.positions.positions_in(0, 6) == [[0, 1, 2, 2, 4, 5], [0, 1, 2, 2, 4, 5], [0, 1, 2, 3, 4, 5]]
    assert images.positions.positions_in(10, 13) == [10, 11, 12]          # text after the images: one row
    assert images.positions.delta == 0 and images.positions.positions_in(13, 14) == [13]
    seq = _seq("grid", ids, images, 0, slot=0)
    assert seq.rope_positions(7, 10) == [[7, 8, 8], [7, 8, 9], [7, 8, 8]]


def test_step_positions_are_three_rows_only_with_a_chunk_over_images():
    ids = [1, 7, IMG, IMG, 7, 7, 7, 7, IMG, IMG, 7, 7, 7]
    text = _seq("text", [7, 7, 7], None, 0, slot=NO_SLOT)
    inputs = build_step_inputs([ScheduledSeq(_seq("grid", ids, _grid_images(), 1, 0), 3, False),
                                ScheduledSeq(text, 3, True)], block_size=16)
    assert inputs.positions == [[0, 1, 2, 1, 2, 2], [0, 1, 2, 1, 2, 2], [0, 1, 2, 1, 2, 3]]
    after = build_step_inputs([ScheduledSeq(_seq("grid", ids, _grid_images(), 10, 0), 3, True),
                               ScheduledSeq(text, 3, True)], block_size=16)
    assert after.positions == [0, 1, 2, 10, 11, 12]
