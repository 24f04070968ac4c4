"""The image processors against transformers' PIL image processors (pixel values within 1e-5) and
its processors (the prompt's token ids, through a character-level tokenizer with the models'
special tokens: every character of the expanded text is one token, so equal ids are equal text)."""

import io
import string
import types

import numpy as np
import pytest
from PIL import Image

from tests.media.pictures import drawn, pictures
from treadle.media import MediaError, decode_image, image_hash, processor_for, processor_from_configs

transformers = pytest.importorskip("transformers")

# The model folders' configs, as published (preprocessor_config.json, processor_config.json).
GEMMA3 = {
    "do_convert_rgb": None,
    "do_normalize": True,
    "do_pan_and_scan": None,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_processor_type": "Gemma3ImageProcessor",
    "image_seq_length": 256,
    "image_std": [0.5, 0.5, 0.5],
    "pan_and_scan_max_num_crops": None,
    "pan_and_scan_min_crop_size": None,
    "pan_and_scan_min_ratio_to_activate": None,
    "processor_class": "Gemma3Processor",
    "resample": 2,
    "rescale_factor": 0.00392156862745098,
    "size": {"height": 896, "width": 896},
}
GEMMA3_PROCESSOR = {"image_seq_length": 256, "processor_class": "Gemma3Processor"}
SMOLVLM = {
    "do_convert_rgb": True,
    "do_image_splitting": True,
    "do_normalize": True,
    "do_pad": True,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_processor_type": "Idefics3ImageProcessor",
    "image_std": [0.5, 0.5, 0.5],
    "max_image_size": {"longest_edge": 512},
    "processor_class": "Idefics3Processor",
    "resample": 1,
    "rescale_factor": 0.00392156862745098,
    "size": {"longest_edge": 2048},
}
SMOLVLM_PROCESSOR = {"image_seq_len": 64, "processor_class": "Idefics3Processor"}
IDEFICS3 = {**SMOLVLM, "max_image_size": {"longest_edge": 364}, "size": {"longest_edge": 1456}}
QWEN2_VL = {
    "min_pixels": 3136,
    "max_pixels": 12845056,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen2VLProcessor",
}
QWEN3_VL = {
    "size": {"longest_edge": 16777216, "shortest_edge": 65536},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Qwen3VLProcessor",
    "image_processor_type": "Qwen2VLImageProcessorFast",
}

# Gemma3Processor.images_kwargs: what the processor passes to its image processor.
GEMMA3_PAN_AND_SCAN = {
    "do_pan_and_scan": True,
    "pan_and_scan_min_crop_size": 256,
    "pan_and_scan_max_num_crops": 4,
    "pan_and_scan_min_ratio_to_activate": 1.2,
}

PICTURES = pictures()
MAX_PIXELS = 10_000_000


def reference_image(data: bytes) -> Image.Image:
    """What a transformers user passes: the file as Pillow opens it, mode and all."""
    return Image.open(io.BytesIO(data))


def ours(config, data, processor_config=None, overrides=None):
    processor = processor_from_configs(config, processor_config, overrides=overrides)
    return processor.preprocess(decode_image(data, max_pixels=MAX_PIXELS))


def assert_close(ours_, theirs):
    theirs = np.asarray(theirs)
    assert ours_.dtype == np.float32
    assert ours_.shape == theirs.shape
    np.testing.assert_allclose(ours_, theirs, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", sorted(PICTURES))
def test_gemma3_pixels_match_transformers(name):
    reference = transformers.Gemma3ImageProcessorPil(**GEMMA3)
    theirs = reference(reference_image(PICTURES[name]), do_convert_rgb=True)
    processed = ours(GEMMA3, PICTURES[name], GEMMA3_PROCESSOR)
    assert_close(processed.pixel_values, theirs["pixel_values"])
    assert processed.num_tokens == 256


@pytest.mark.parametrize("name", ["wide_partial_crops", "tall", "logo_rgba_wide", "grace_hopper_jpeg"])
def test_gemma3_pan_and_scan_matches_transformers(name):
    reference = transformers.Gemma3ImageProcessorPil(**GEMMA3)
    theirs = reference(reference_image(PICTURES[name]), do_convert_rgb=True, **GEMMA3_PAN_AND_SCAN)
    processed = ours(GEMMA3, PICTURES[name], GEMMA3_PROCESSOR, overrides={"do_pan_and_scan": True})
    assert_close(processed.pixel_values, theirs["pixel_values"])
    assert len(processed.pixel_values) == 1 + theirs["num_crops"][0]


@pytest.mark.parametrize("config", [SMOLVLM, IDEFICS3], ids=["smolvlm", "idefics3"])
@pytest.mark.parametrize(
    "name", ["grace_hopper_jpeg", "logo_rgba_wide", "portrait_rgba", "palette_transparent", "tiny"]
)
def test_idefics3_pixels_match_transformers(config, name):
    reference = transformers.Idefics3ImageProcessorPil(**config)
    theirs = reference(reference_image(PICTURES[name]), return_row_col_info=True)
    processed = ours(config, PICTURES[name])
    assert_close(processed.pixel_values, theirs["pixel_values"][0])
    assert np.all(theirs["pixel_attention_mask"][0] == 1)  # one image: no padding to carry


def test_idefics3_without_splitting_matches_transformers():
    config = {**IDEFICS3, "do_image_splitting": False}
    reference = transformers.Idefics3ImageProcessorPil(**config)
    theirs = reference(reference_image(PICTURES["grace_hopper_jpeg"]))
    assert_close(ours(config, PICTURES["grace_hopper_jpeg"]).pixel_values, theirs["pixel_values"][0])


def test_smolvlm_image_processor_is_idefics3s():
    config = {**SMOLVLM, "image_processor_type": "SmolVLMImageProcessor", "processor_class": "SmolVLMProcessor"}
    reference = transformers.SmolVLMImageProcessorPil(**config)
    theirs = reference(reference_image(PICTURES["landscape_odd"]))
    assert_close(ours(config, PICTURES["landscape_odd"]).pixel_values, theirs["pixel_values"][0])


@pytest.mark.parametrize("config", [QWEN2_VL, QWEN3_VL], ids=["qwen2_vl", "qwen3_vl"])
@pytest.mark.parametrize("name", sorted(set(PICTURES) - {"wide_partial_crops"}))
def test_qwen_vl_pixels_and_grid_match_transformers(config, name):
    reference = transformers.Qwen2VLImageProcessorPil(**config)
    theirs = reference(reference_image(PICTURES[name]), do_convert_rgb=True)
    processed = ours(config, PICTURES[name])
    assert_close(processed.pixel_values, theirs["pixel_values"])
    np.testing.assert_array_equal(processed.extra_inputs["image_grid_thw"], theirs["image_grid_thw"])


def test_qwen_vl_pixel_bounds_in_size_are_read():
    """Some Qwen2-VL folders put min_pixels / max_pixels inside size (transformers fails on them)."""
    config = {**QWEN2_VL, "size": {"min_pixels": 3136, "max_pixels": 28 * 28 * 64}}
    del config["min_pixels"], config["max_pixels"]
    processed = ours(config, PICTURES["grace_hopper_jpeg"])
    bounded = ours({**QWEN2_VL, "max_pixels": 28 * 28 * 64}, PICTURES["grace_hopper_jpeg"])
    np.testing.assert_array_equal(processed.extra_inputs["image_grid_thw"], bounded.extra_inputs["image_grid_thw"])
    assert processed.num_tokens <= 64


def test_qwen_vl_refuses_an_extreme_aspect_ratio():
    with pytest.raises(MediaError, match="aspect ratio") as e:
        processor_from_configs(QWEN2_VL).preprocess(drawn(1005, 5, 0), param="messages[0].content[0]")
    assert e.value.param == "messages[0].content[0]"


def tiny_tokenizer(**model_tokens):
    """A character-level tokenizer knowing the vision models' special tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    special = [
        "<start_of_image>",
        "<image_soft_token>",
        "<end_of_image>",
        "<fake_token_around_image>",
        "<image>",
        "<global-img>",
        "<end_of_utterance>",
        *(f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)),
    ]
    backend = Tokenizer(models.WordLevel({c: i for i, c in enumerate(["[UNK]", *string.printable])}, "[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    backend.add_special_tokens(special)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", extra_special_tokens=model_tokens
    )


def test_gemma3_prompt_ids_match_the_transformers_processor():
    tokenizer = tiny_tokenizer(
        boi_token="<start_of_image>", eoi_token="<end_of_image>", image_token="<image_soft_token>"
    )
    reference = transformers.Gemma3Processor(
        transformers.Gemma3ImageProcessorPil(**GEMMA3), tokenizer, image_seq_length=256
    )
    text = "<start_of_turn>user\nCompare <start_of_image> and <start_of_image>, please.<end_of_turn>\n"
    images = [PICTURES["grace_hopper_jpeg"], PICTURES["portrait_rgba"]]
    theirs = reference(text=[text], images=[[reference_image(b) for b in images]])
    processor = processor_from_configs(GEMMA3, GEMMA3_PROCESSOR)
    processed = [processor.preprocess(decode_image(b, max_pixels=MAX_PIXELS)) for b in images]
    assert tokenizer(processor.expand_prompt(text, processed))["input_ids"] == theirs["input_ids"][0]
    assert_close(np.concatenate([p.pixel_values for p in processed]), theirs["pixel_values"])
    image_token_id = tokenizer.convert_tokens_to_ids("<image_soft_token>")
    assert theirs["input_ids"][0].count(image_token_id) == sum(p.num_tokens for p in processed)


def test_gemma3_pan_and_scan_prompt_matches_the_transformers_processor():
    tokenizer = tiny_tokenizer(
        boi_token="<start_of_image>", eoi_token="<end_of_image>", image_token="<image_soft_token>"
    )
    reference = transformers.Gemma3Processor(
        transformers.Gemma3ImageProcessorPil(**GEMMA3), tokenizer, image_seq_length=8
    )
    text = "Look: <start_of_image>"
    theirs = reference(text=[text], images=[[reference_image(PICTURES["wide_partial_crops"])]], do_pan_and_scan=True)
    processor = processor_from_configs(GEMMA3, {"image_seq_length": 8}, overrides={"do_pan_and_scan": True})
    processed = processor.preprocess(decode_image(PICTURES["wide_partial_crops"], max_pixels=MAX_PIXELS))
    assert len(processed.pixel_values) == 4  # the image and three crops
    assert tokenizer(processor.expand_prompt(text, [processed]))["input_ids"] == theirs["input_ids"][0]


@pytest.mark.parametrize(
    "config",
    [SMOLVLM, IDEFICS3, {**IDEFICS3, "do_image_splitting": False}],
    ids=["smolvlm", "idefics3", "idefics3_unsplit"],
)
def test_idefics3_prompt_ids_match_the_transformers_processor(config):
    tokenizer = tiny_tokenizer()
    reference = transformers.Idefics3Processor(
        transformers.Idefics3ImageProcessorPil(**config), tokenizer, image_seq_len=5
    )
    text = "User:<image>What is in this image? And <image>?<end_of_utterance>\nAssistant:"
    images = [PICTURES["grace_hopper_jpeg"], PICTURES["tiny"]]
    theirs = reference(text=[text], images=[[reference_image(b) for b in images]])
    processor = processor_from_configs(config, {"image_seq_len": 5})
    processed = [processor.preprocess(decode_image(b, max_pixels=MAX_PIXELS)) for b in images]
    assert tokenizer(processor.expand_prompt(text, processed))["input_ids"] == theirs["input_ids"][0]
    assert ("<row_1_col_1>" in processed[0].placeholder) == config["do_image_splitting"]
    image_token_id = tokenizer.convert_tokens_to_ids("<image>")
    assert theirs["input_ids"][0].count(image_token_id) == sum(p.num_tokens for p in processed)


@pytest.mark.parametrize(
    "config, processor_class",
    [(QWEN2_VL, "Qwen2VLProcessor"), (QWEN2_VL, "Qwen2_5_VLProcessor"), (QWEN3_VL, "Qwen3VLProcessor")],
)
def test_qwen_vl_placeholder_is_the_transformers_processors(config, processor_class):
    """The processor itself wants torchvision (its video processor): its replace_image_token is
    called on the image processor's output instead."""
    reference = transformers.Qwen2VLImageProcessorPil(**config)
    theirs = reference(reference_image(PICTURES["grace_hopper_jpeg"]))
    fake_processor = types.SimpleNamespace(image_processor=reference, image_token="<|image_pad|>")
    expected = getattr(transformers, processor_class).replace_image_token(fake_processor, theirs, image_idx=0)
    processor = processor_from_configs({**config, "processor_class": processor_class})
    processed = processor.preprocess(decode_image(PICTURES["grace_hopper_jpeg"], max_pixels=MAX_PIXELS))
    assert processed.placeholder == expected
    assert processed.num_tokens == expected.count("<|image_pad|>")
    text = "<|vision_start|><|image_pad|><|vision_end|>Describe."
    assert processor.expand_prompt(text, [processed]) == f"<|vision_start|>{expected}<|vision_end|>Describe."


def test_expand_prompt_refuses_a_marker_count_unlike_the_image_count():
    processor = processor_from_configs(GEMMA3)
    processed = processor.preprocess(drawn(20, 20, 0))
    with pytest.raises(MediaError, match="2 <start_of_image> for 1 images"):
        processor.expand_prompt("<start_of_image><start_of_image>", [processed], param="messages")


@pytest.mark.parametrize(
    "configs, expected",
    [
        ({"preprocessor_config.json": GEMMA3}, "Gemma3Images"),
        ({"preprocessor_config.json": {**SMOLVLM, "image_processor_type": "SmolVLMImageProcessor"}}, "Idefics3Images"),
        ({"preprocessor_config.json": QWEN3_VL}, "QwenVLImages"),
        # transformers 5 nests the image processor in processor_config.json, and reads it first
        ({"processor_config.json": {"image_processor": QWEN2_VL}, "preprocessor_config.json": GEMMA3}, "QwenVLImages"),
        (
            {
                "preprocessor_config.json": {"size": {"height": 896, "width": 896}},
                "config.json": {"model_type": "gemma3"},
            },
            "Gemma3Images",
        ),
    ],
)
def test_processor_for_a_model_folder_picks_by_type_class_or_model(tmp_path, configs, expected):
    import json

    for name, config in configs.items():
        (tmp_path / name).write_text(json.dumps(config))
    assert type(processor_for(tmp_path)).__name__ == expected


def test_processor_for_an_unknown_model_says_what_it_got():
    with pytest.raises(ValueError, match="LlavaImageProcessor"):
        processor_from_configs({"image_processor_type": "LlavaImageProcessor"})


def test_an_unknown_override_is_refused_by_name():
    with pytest.raises(ValueError, match="do_pan_scan"):
        processor_from_configs(GEMMA3, overrides={"do_pan_scan": True})
    assert (
        processor_from_configs(QWEN2_VL, overrides={"max_pixels": 28 * 28 * 64}).settings["size"]["longest_edge"]
        == 50176
    )


def test_image_seq_len_comes_from_the_model_config_when_the_processor_config_lacks_it():
    model_config = {"model_type": "idefics3", "scale_factor": 4, "vision_config": {"image_size": 512, "patch_size": 16}}
    processor = processor_from_configs({**SMOLVLM, "do_image_splitting": False}, {}, model_config)
    assert processor.preprocess(drawn(20, 20, 0)).num_tokens == 64  # (512/16)^2 / 4^2, SmolVLM's


def test_the_image_key_differs_with_the_settings_that_change_the_output():
    image = drawn(40, 30, 0)
    keys = {
        image_hash(image, processor_from_configs(config, overrides=overrides).settings)
        for config, overrides in [(GEMMA3, {}), (GEMMA3, {"do_pan_and_scan": True}), (QWEN2_VL, {}), (QWEN3_VL, {})]
        + [(QWEN2_VL, {"max_pixels": 28 * 28 * 64}), (SMOLVLM, {}), (IDEFICS3, {})]
    }
    assert len(keys) == 7
    assert image_hash(image, processor_from_configs(GEMMA3).settings) == image_hash(
        image.copy(), processor_from_configs(dict(GEMMA3)).settings
    )
