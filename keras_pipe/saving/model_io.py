"""The saving methods of `PipelineModel`: `.keras` files, weights, export.

A mixin before `keras.Model` in `PipelineModel`'s bases, so that the Keras
model module stays Keras glue; the logic lives in `files` and `export`.
"""

from keras_pipe.saving import export as export_lib
from keras_pipe.saving import files as saving

__all__ = ["SavingMethods"]


class SavingMethods:
    """`PipelineModel`'s saving, loading and export methods."""

    @property
    def layers(self):
        """The unpipelined model's layers, stage after stage.

        Nested Sequential/Functional stages are opened up, so that weights
        files have the plain model's layout whatever the cut.
        """
        return saving.flat_layers(self._stage_layers)

    @property
    def _seed_states(self):
        # Walked by Keras saving: seed generator states (Dropout masks).
        return saving.SeedStates(self.layers)

    def get_config(self):
        return saving.get_config(self, super().get_config())

    @classmethod
    def from_config(cls, config, custom_objects=None):
        return saving.from_config(cls, config, custom_objects)

    def compile_from_config(self, config):
        saving.compile_from_config(self, config)

    def load_own_variables(self, store):
        saving.check_store(self, store)
        super().load_own_variables(store)

    def save(self, filepath, overwrite=True, **kwargs):
        """Same as `keras.Model.save`, atomic: a crash keeps the old file."""
        return saving.save_model(super().save, filepath, overwrite, **kwargs)

    def save_weights(self, filepath, overwrite=True, max_shard_size=None):
        """Same as `keras.Model.save_weights`, atomic like `save`, with a
        checksum of each weight that `load_weights` verifies."""
        return saving.save_weights(self, super().save_weights, filepath,
                                   overwrite, max_shard_size)

    def load_weights(self, filepath, skip_mismatch=False, **kwargs):
        """Same as `keras.Model.load_weights`, checked (checksums, layout)
        and all or nothing."""
        saving.load_weights(
            self, filepath, skip_mismatch=skip_mismatch,
            load=lambda: super(SavingMethods, self).load_weights(
                filepath, skip_mismatch=skip_mismatch, **kwargs))

    def to_model(self, name=None):
        """The unpipelined Functional model, sharing this model's layers."""
        return export_lib.to_model(self, name=name)

    def export(self, filepath, format="tf_saved_model", verbose=None,
               input_signature=None, pipelined=False, **kwargs):
        """Exports the model for serving; see `keras_pipe.saving.export.export`."""
        return export_lib.export(self, filepath, format=format,
                                 verbose=verbose,
                                 input_signature=input_signature,
                                 pipelined=pipelined, **kwargs)
