"""Engine integrations, each in its own module and imported only by its engine (never by `wna16_loader`)."""
