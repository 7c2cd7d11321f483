"""Sub-configs keep their ``model_type`` in the gate's tiny copy: Exaone-4.5 and MusicFlamingo read it when they
build their text and audio configs (their copies failed with ``KeyError: 'model_type'``, and the gate refused them
saying stock runs no small copy). Each is now proved on a tiny copy of its config class's defaults, against each
sample alone on stock."""

from __future__ import annotations

import pytest
import transformers

import packfree_plugin
from packfree_plugin.gate.admission import prove_copy
from packfree_plugin.gate.shrink import shrink_config


@pytest.mark.parametrize(("config_name", "class_name", "sub_config"), [
    ("Exaone4_5_Config", "Exaone4_5_ForConditionalGeneration", "text_config"),
    ("MusicFlamingoConfig", "MusicFlamingoForConditionalGeneration", "audio_config"),
])
def test_a_config_that_reads_its_sub_configs_model_type_is_proved(config_name: str, class_name: str,
                                                                  sub_config: str) -> None:
    packfree_plugin.register()
    config = getattr(transformers, config_name)()
    tiny = shrink_config(config)
    assert getattr(tiny, sub_config).model_type == getattr(config, sub_config).model_type
    proof = prove_copy(getattr(transformers, class_name), config)
    assert proof.exact, proof.summary()
