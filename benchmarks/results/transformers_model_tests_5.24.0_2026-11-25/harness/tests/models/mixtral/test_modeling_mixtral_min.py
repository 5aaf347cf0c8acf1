# Minimal tester written for moe_ep#15 (the real tests/models files are not in the sdist).
import unittest
from transformers import MixtralConfig, is_torch_available
from transformers.testing_utils import require_torch, torch_device
from ...test_modeling_common import ModelTesterMixin, ids_tensor
from ...test_fsdp_mixin import FSDPTesterMixin
from ...test_training_mixin import TrainingTesterMixin
if is_torch_available():
    import torch
    from transformers import MixtralForCausalLM, MixtralModel


class MixtralModelTester:
    def __init__(self, parent, batch_size=13, seq_length=7, is_training=True, vocab_size=99, hidden_size=32,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=32,
                 max_position_embeddings=512, pad_token_id=0):
        self.parent = parent
        self.batch_size, self.seq_length, self.is_training = batch_size, seq_length, is_training
        self.vocab_size, self.hidden_size, self.num_hidden_layers = vocab_size, hidden_size, num_hidden_layers
        self.num_attention_heads, self.num_key_value_heads = num_attention_heads, num_key_value_heads
        self.intermediate_size, self.max_position_embeddings, self.pad_token_id = intermediate_size, max_position_embeddings, pad_token_id
        self.use_labels = True
        self.causal_lm_class = MixtralForCausalLM
        self.base_model_class = MixtralModel

    def get_config(self):
        return MixtralConfig(vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                             num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
                             num_key_value_heads=self.num_key_value_heads, intermediate_size=self.intermediate_size,
                             max_position_embeddings=self.max_position_embeddings, pad_token_id=self.pad_token_id,
                             num_experts_per_tok=2, num_local_experts=4)

    def prepare_config_and_inputs(self):
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        mask = torch.tril(torch.ones(self.batch_size, self.seq_length)).to(torch_device)
        return self.get_config(), input_ids, mask

    def prepare_config_and_inputs_for_common(self):
        config, input_ids, mask = self.prepare_config_and_inputs()
        return config, {"input_ids": input_ids, "attention_mask": mask}


@require_torch
class MixtralMinTest(ModelTesterMixin, FSDPTesterMixin, unittest.TestCase):
    all_model_classes = (MixtralModel, MixtralForCausalLM) if is_torch_available() else ()

    def setUp(self):
        self._model_tester = MixtralModelTester(self)

    @property
    def model_tester(self):
        return self._model_tester

    @model_tester.setter
    def model_tester(self, value):
        self._model_tester = value
