"""The report: what a person reads (`report`: text, markdown, plots), the progress line of
each epoch (`progress`) and the outer sync in words (`sync_words`). The top room of the
coordinator; values go through `core.formats`."""
