// The fused elementwise optimizers the launchers know, by name (functor.h): one include and one entry each.
#pragma once

#include "adamw.h"
#include "lion.h"

namespace gaengine {
namespace optim {

using AllOptimizers = OptimizerList<AdamW, Lion>;

}  // namespace optim
}  // namespace gaengine
