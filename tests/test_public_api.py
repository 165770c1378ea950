"""The public surface is small and pinned; importing gaengine is lean."""

import subprocess
import sys

import gaengine


def test_all_is_pinned():
    assert sorted(gaengine.__all__) == sorted([
        "AccumulatorConfig", "EquivalenceReport", "GradientAccumulator", "MicroBatches", "StepResult",
        "clip_grad_norm_", "find_micro_batch_size", "full_optimizer_state_dict", "ops", "optim", "scale_lr",
        "schedules", "split_batch", "verify_equivalence", "__version__",
    ])
    for name in gaengine.__all__:
        assert hasattr(gaengine, name), name
    assert callable(gaengine.optim.FusedAdamW)
    assert callable(gaengine.schedules.RampUp) and callable(gaengine.schedules.Milestones)


def test_import_is_lean():
    code = ("import sys, torch, gaengine; "
            "bad = [m for m in sys.modules if m == 'triton' or m.startswith('triton.') or m == 'gaengine._C' "
            "or m in ('gaengine.checkpoint', 'torch.distributed.checkpoint')]; "
            "assert not bad, bad; assert not torch.cuda.is_initialized(); print('lean')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "lean" in out.stdout, out.stderr
