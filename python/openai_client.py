"""Chat with a running sgl-jax server through the official openai client, plain and streamed.

Start a server first (the built-in demo model if no --model-path is given):

    python -m sgl_jax.launch_server
    python python/openai_client.py                      # talks to http://127.0.0.1:30000/v1
    python python/openai_client.py --base-url http://HOST:PORT/v1 --api-key KEY

The demo model is SmolLM2-135M-Instruct: a real, if small, chat model.

Needs the `openai` package, which `pip install -e .` does not install (the server does not
use it): `pip install openai` (or `pip install -e ".[test]"`).
"""

import argparse
import os
import sys

try:
    import openai
except ImportError:
    sys.exit("python/openai_client.py needs the openai package, which `pip install -e .` does "
             "not install: pip install openai")

MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Name three colours of the rainbow."}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:30000/v1")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "none"),
                        help="the server's --api-key, if it has one")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = client.models.list().data[0].id
    print(f"model: {model}")

    reply = client.chat.completions.create(model=model, messages=MESSAGES, temperature=0,
                                           max_tokens=args.max_tokens)
    print(f"plain:    {reply.choices[0].message.content!r}")
    print(f"          finish_reason={reply.choices[0].finish_reason}, usage={reply.usage}")

    stream = client.chat.completions.create(model=model, messages=MESSAGES, temperature=0,
                                            max_tokens=args.max_tokens, stream=True,
                                            stream_options={"include_usage": True})
    pieces = []
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        elif chunk.usage is not None:
            print(f"streamed: {''.join(pieces)!r}")
            print(f"          {len(pieces)} chunks, usage={chunk.usage}")


if __name__ == "__main__":
    main()
