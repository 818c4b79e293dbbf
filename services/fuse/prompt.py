"""One example as the served API sees it, and the text its adapter learns to answer with.

Every task is served as generation (docs/fuse.md): the adapter writes its answer as text, so one fused adapter
answers any mix of tasks through chat completions at temperature 0.
    classification  {"label": "circle"}                                   -> "circle"
    generation      {"answer": "3"}                                       -> "3"
    detection       {"boxes": [{"label": "square", "box": [0.1, 0.2, 0.4, 0.5]}]}
                                                                          -> "square 0.10 0.20 0.40 0.50"
"""

from __future__ import annotations

from gpu_worker.prompts import ChatMessage, ImagePart, Prompt
from gpu_worker.vision.video import VideoPart
from services.fuse.data import Box, Example
from services.fuse.manifest import Task

BOX_DECIMALS = 2


def box_line(box: Box) -> str:
    return " ".join([box.label, *(f"{c:.{BOX_DECIMALS}f}" for c in box.box)])


def target_text(example: Example, task: Task) -> str:
    """The text the adapter is trained to generate for `example`; one line per box for detection."""
    if task.type == "classification":
        assert example.label is not None, f"line {example.line}: a classification example without a label"
        return example.label
    if task.type == "generation":
        assert example.answer is not None, f"line {example.line}: a generation example without an answer"
        return example.answer.strip()  # compared stripped, so trained stripped
    assert example.boxes is not None, f"line {example.line}: a detection example without boxes"
    return "\n".join(box_line(box) for box in example.boxes)


def served_prompt(example: Example) -> Prompt:
    """The chat prompt a client sends for `example`: one user message, its images (or video) first, then the
    text (docs/fuse.md). Files are read as bytes, as a request carries them."""
    media: tuple[ImagePart | VideoPart, ...]
    if example.video:
        media = (VideoPart(frames=tuple(path.read_bytes() for path in example.video)),)
    else:
        media = tuple(ImagePart(path.read_bytes()) for path in example.images)
    return (ChatMessage("user", (*media, example.prompt)),)
