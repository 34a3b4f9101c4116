"""The vLLM stand-ins behave like vLLM's base classes: abstract methods stay abstract, optional
ones return vLLM's defaults, metadata binding works, and the data classes pickle."""

from __future__ import annotations

import pickle

import pytest

from pegaflow.connector.vllm_api import (
    KVCacheBlock,
    KVCacheBlocks,
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
    KVTransferConfig,
    SchedulerOutput,
    VllmConfig,
)


class Minimal(KVConnectorBase_V1):
    def start_load_kv(self, forward_context, **kwargs):
        return super().start_load_kv(forward_context, **kwargs)

    def wait_for_layer_load(self, layer_name):
        return None

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        return None

    def wait_for_save(self):
        return None

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        return None

    def build_connector_meta(self, scheduler_output):
        return Meta()


class Meta(KVConnectorMetadata):
    pass


def cfg(**extra) -> VllmConfig:
    return VllmConfig(kv_transfer_config=KVTransferConfig("Minimal", kv_role="kv_both", kv_connector_extra_config=extra))


def test_a_connector_missing_an_abstract_method_cannot_be_built():
    class Partial(KVConnectorBase_V1):
        def wait_for_save(self):
            return None

    with pytest.raises(TypeError, match="abstract"):
        Partial(cfg(), KVConnectorRole.WORKER, None)


def test_optional_methods_return_vllms_defaults_and_abstract_ones_raise_through_super():
    c = Minimal(cfg(), KVConnectorRole.WORKER, None)
    assert c.role is KVConnectorRole.WORKER
    assert c.get_finished({"a"}) == (None, None)
    assert c.get_block_ids_with_load_errors() == set()
    assert c.request_finished(object(), [1]) == (False, None)
    assert c.build_connector_worker_meta() is None and c.get_kv_connector_stats() is None
    assert list(c.take_events()) == [] and c.prefer_cross_layer_blocks is False
    assert c.requires_kv_delivery is True  # kv_both is a producer, as in vLLM
    with pytest.raises(NotImplementedError):
        c.start_load_kv(None)


def test_metadata_binds_and_clears():
    c = Minimal(cfg(), KVConnectorRole.WORKER, None)
    assert not c.has_connector_metadata()
    m = Meta()
    c.bind_connector_metadata(m)
    assert c.has_connector_metadata() and c._get_connector_metadata() is m
    c.clear_connector_metadata()
    assert not c.has_connector_metadata()


def test_a_connector_needs_a_kv_transfer_config():
    with pytest.raises(ValueError, match="kv_transfer_config"):
        Minimal(VllmConfig(), KVConnectorRole.SCHEDULER, None)


def test_extra_config_lookup_and_data_classes_pickle():
    assert cfg(a=1).kv_transfer_config.get_from_extra_config("a", 0) == 1
    assert cfg().kv_transfer_config.get_from_extra_config("a", 7) == 7
    blocks = KVCacheBlocks(([KVCacheBlock(3), KVCacheBlock(5)],))
    assert blocks.get_block_ids() == ([3, 5],)
    assert KVCacheBlocks(([],)).get_block_ids(allow_none=True) is None
    out = KVConnectorOutput(finished_sending={"r"}, invalid_block_ids={4})
    assert not out.is_empty() and KVConnectorOutput().is_empty()
    for obj in (SchedulerOutput.make_empty(), out, cfg(x=[1])):
        assert pickle.loads(pickle.dumps(obj)) == obj
