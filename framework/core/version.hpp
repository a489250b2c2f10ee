#pragma once
// The framework's version, recorded in checkpoints and printed by the command.

namespace meshtrain {
const char* framework_version();
}
