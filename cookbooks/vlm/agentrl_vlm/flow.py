"""Two agents that count shapes: one look and an answer, or a look, a zoom tool call, then the answer.

Both send the picture the way any OpenAI client does, as an `image_url` part holding a data URL
(`build_image_messages` turns verl's `images` + `<image>` rows into those parts). The gateway and the
embedded engine do the rest: the trace of each call holds the image pads and the resized image, and
training reuses exactly those pixels.
"""

from __future__ import annotations

import json
from typing import Any

from agentrl import AgentFlow
from agentrl.data.images import build_image_messages, encode_data_url, load_image

ZOOM_TOOL = {
    "type": "function",
    "function": {
        "name": "zoom",
        "description": "Look closer at one half of the picture.",
        "parameters": {
            "type": "object",
            "properties": {"region": {"type": "string", "enum": ["top", "bottom", "left", "right", "all"]}},
        },
    },
}


def zoom(image: Any, region: str) -> Any:
    """The tool: `region` of the picture ('all' for the whole), scaled back up to the picture's size."""
    width, height = image.size
    boxes = {
        "top": (0, 0, width, height // 2),
        "bottom": (0, height // 2, width, height),
        "left": (0, 0, width // 2, height),
        "right": (width // 2, 0, width, height),
        "all": (0, 0, width, height),
    }
    return image.crop(boxes.get(region, boxes["all"])).resize((width, height))


class CountFlow(AgentFlow):
    """One call: the picture and the question; the reply is the answer."""

    def __init__(self, prompt_key: str = "prompt") -> None:
        self.prompt_key = prompt_key

    async def run(self, task, ctx) -> str:
        messages = build_image_messages(task[self.prompt_key], task.get("images"), f"task {task.id}")
        reply = await ctx.client.chat.completions.create(model=ctx.model, messages=messages)
        return reply.choices[0].message.content or ""


class ZoomFlow(AgentFlow):
    """Two calls: look (the model may call `zoom`), see the zoomed picture, then answer.

    The first call offers the `zoom` tool; a call with a region zooms there, anything else zooms to 'all'.
    The zoomed picture comes back as the tool's result followed by a user turn holding it (the chat template
    renders images in user turns). The second prompt restates the first reply with its zoom call, so unless the
    model wrote that call itself the two calls train as two rows (the second holding both pictures).
    """

    def __init__(self, prompt_key: str = "prompt") -> None:
        self.prompt_key = prompt_key

    async def run(self, task, ctx) -> str:
        messages = build_image_messages(task[self.prompt_key], task.get("images"), f"task {task.id}")
        look = await ctx.client.chat.completions.create(model=ctx.model, messages=messages, tools=[ZOOM_TOOL])
        reply = look.choices[0].message
        region, call_id = "all", "call_zoom"
        if reply.tool_calls:
            call = reply.tool_calls[0]
            call_id = call.id
            try:
                region = json.loads(call.function.arguments or "{}").get("region", "all")
            except (json.JSONDecodeError, AttributeError):
                region = "all"
        picture = zoom(load_image(task["images"][0], f"task {task.id}"), region)
        messages += [
            {"role": "assistant", "content": reply.content or "", "tool_calls": [
                {"id": call_id, "type": "function", "function": {"name": "zoom", "arguments": json.dumps({"region": region})}}
            ]},
            {"role": "tool", "tool_call_id": call_id, "content": f"zoomed to {region}"},
            {"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": encode_data_url(picture)}},
                {"type": "text", "text": "How many shapes in the whole picture? Answer with one digit."},
            ]},
        ]  # fmt: skip
        answer = await ctx.client.chat.completions.create(model=ctx.model, messages=messages)
        return answer.choices[0].message.content or ""
