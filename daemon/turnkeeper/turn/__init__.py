"""One turn, step by step: the record people see, the conversation, the runner."""
