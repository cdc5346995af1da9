"""What a chat model's reply holds besides its answer, read from the text as it streams: its reasoning (a think
block, or gpt-oss's analysis channel) and its tool calls, one parser per model family.

Every parser is a stream first: it is fed the reply's text in pieces and hands back what can be sent now, holding
back only what may still turn out to be one of its tags or a call. Parsing a whole reply is one feed and the
finish, so a reply streamed in any pieces reads exactly as it does whole.

- reasoning/: the reasoning parsers (think tags; gpt-oss's channels), by name and chosen from a template;
- tools/: the tool-call parsers, one module a format, by name and chosen from a template;
- harmony.py: gpt-oss's harmony messages as text (headers: channel, recipient), which both read;
- calls.py: a parsed call; text.py: what a stream may hold back.

The reasoning parser runs first; the tool-call parser reads the content it leaves.
"""
