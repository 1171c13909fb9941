// The world of one process: every collective is a copy (or nothing), complete on return.
#pragma once
#include <memory>

#include "dist/communicator.h"

namespace moe::dist {

std::unique_ptr<Communicator> make_single_communicator();

}  // namespace moe::dist
