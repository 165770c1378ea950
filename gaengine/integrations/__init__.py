"""Drop-in integrations of gaengine with the trainers users already run; each submodule imports its framework only
when imported itself (``import gaengine`` and ``import gaengine.integrations`` import none).

* ``gaengine.integrations.transformers``: ``GaengineTrainer``, a ``transformers.Trainer`` subclass
  (``pip install gaengine[transformers]``; docs/integrations/transformers.md).
* ``gaengine.integrations.accelerate``: ``GaengineAccelerator``, an ``accelerate.Accelerator`` subclass
  (``pip install gaengine[accelerate]``; docs/integrations/accelerate.md).
* ``gaengine.integrations.lightning``: a Lightning ``Strategy`` and ``Precision`` plugin
  (``pip install gaengine[lightning]``).
"""
