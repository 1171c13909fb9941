// Preemption: the first SIGTERM or SIGINT asks the trainer to finish its step, save a
// checkpoint and exit 0; a second one exits at once (status 128 + signal).
#pragma once

namespace moe {

// Installs the handlers (idempotent). The CLI calls this; library users need not.
void install_stop_signal_handlers();
// True once a stop signal arrived (or request_stop() was called).
bool stop_requested();
// The signal that asked to stop, 0 if none (or a request_stop()).
int stop_signal();
// Asks for a stop as a signal would (tests); clear_stop_request() undoes it.
void request_stop();
void clear_stop_request();

}  // namespace moe
