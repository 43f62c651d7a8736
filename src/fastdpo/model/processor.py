"""The processor of a vision-language model dir (tokenizer, image processor, chat template), for rows with images.

`AutoProcessor` builds it. Without torchvision, transformers 5 cannot build the Qwen processors (Qwen2-VL, Qwen2.5-VL,
Qwen3-VL: each checks its video processor against a class that needs torchvision): the processor is then built from
the dir's tokenizer, its image processor on the PIL backend and its chat template, without a video processor
(fastdpo reads no videos).
"""

from __future__ import annotations

from pathlib import Path

from fastdpo.errors import FastDPOError
from fastdpo.model.load import check_vision_family, is_vision_config

# The processor class of each Qwen family, built from its parts where AutoProcessor cannot build it (no torchvision)
QWEN_PROCESSORS = {"qwen2_vl": "Qwen2VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor", "qwen3_vl": "Qwen3VLProcessor"}


def is_vision_model(path: str | Path, trust_remote_code: bool = False) -> bool:
    """The model dir's config is a vision-language model fastdpo trains (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, LLaVA:
    `is_vision_config`)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception:  # a tokenizer dir without a model config: not a vision-language model
        return False
    check_vision_family(config, str(path))
    return is_vision_config(config)


def image_only_processor(cls, image_processor, tokenizer, chat_template: str | None):
    """A processor of class `cls` (Qwen2-VL's kind) without a video processor, also where transformers cannot check
    one (no torchvision)."""
    try:
        return cls(image_processor=image_processor, tokenizer=tokenizer, chat_template=chat_template)
    except (AttributeError, TypeError):  # the video processor's class check needs torchvision (5.17: a TypeError)
        from unittest import mock

        with mock.patch.object(cls, "check_argument_for_proper_class", lambda *a: None):
            return cls(image_processor=image_processor, tokenizer=tokenizer, video_processor=None,
                       chat_template=chat_template)


def load_processor(path: str | Path, trust_remote_code: bool = False):
    """The processor saved in a vision-language model dir; a FastDPOError when it has none."""
    import transformers
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    try:
        return AutoProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as e:
        first = e
    try:  # without torchvision: the parts, on the PIL image backend
        config = transformers.AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        name = QWEN_PROCESSORS.get(config.model_type)
        if name is None:
            raise first
        images = AutoImageProcessor.from_pretrained(path, backend="pil")
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        template = getattr(tokenizer, "chat_template", None)
        jinja = Path(path) / "chat_template.jinja"
        if jinja.is_file():
            template = jinja.read_text(encoding="utf-8")
        return image_only_processor(getattr(transformers, name), images, tokenizer, template)
    except Exception:
        raise FastDPOError(f"{path}: cannot load the model's processor ({type(first).__name__}: {first}). Rows with "
                           "images need the processor saved with a vision-language model (preprocessor_config.json "
                           "beside the tokenizer).") from None
