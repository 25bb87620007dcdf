"""`POST /v1/responses` (OpenAI's Responses API), with `GET` and `DELETE /v1/responses/{id}` over the responses
this server keeps, for text models with a chat template.

A response is a chat completion in another envelope: the body's `instructions` (a system message first), its
`input` (a string, or items: messages whose content is a string or `input_text` / `output_text` parts, the
model's earlier `function_call`s and their `function_call_output`s) and, with `previous_response_id`, the
conversation of a response this server kept, become chat messages; they are rendered with the model's chat
template as /v1/chat/completions renders them (`service.protocols.chat_api.chat_prompt`, function tools through
`service.protocols.tools`), built into a `GenerationRequest` (max_output_tokens, temperature, top_p; `text.format`
as chat's `response_format`: structured output) and run by `service.protocols.generation`, whose answer
`ResponsesFormat` shapes: one response object (`output`: an assistant message with one `output_text` part and/or
`function_call` items; `status` completed, or incomplete with `incomplete_details` when max_output_tokens ended
it), or a stream of the Responses events, each with its `sequence_number` (`event:` lines name them; no `[DONE]`).

Kept responses (`store`, true unless the body says false, as OpenAI's): the last MAX_STORED of them, within
MAX_STORED_CHARS of conversation, in this server process's memory (lost on restart; each replica has its own). A
response's kept conversation is its input (without its instructions, which OpenAI does not carry over) and its
output. Undeclared fields are judged by `service.protocols.fields` as on chat (RESPONSES_NOT_SUPPORTED).

Its modules, by job: `schema` (the body and its undeclared fields), `translate` (the body in chat's terms),
`store` (kept responses), `answer` (the response object and its stream of events), `routes` (the three routes).
"""
