"""A scripted long multi-turn chat: between turns the conversation's cache is parked (host memory, or disk
once the store's host budget is full); when the next turn comes, the store starts reading it back from disk
at once (`SessionStore.resume`; `SessionStore.prefetch` starts earlier, while the user types), and every layer
is restored before the turn's prefill. A second copy of the conversation that is never parked checks that
parking changes nothing.

    python examples/long_chat.py [--short] [--device cpu|cuda|cuda:N]
"""

import argparse

import torch

from kvtier import load_default_model
from kvtier.cli.format import human_bytes
from kvtier.integrations.chat import ChatSession
from kvtier.integrations.sessions import SessionStore

TURNS = [
    "Hi! My name is Ada. I keep the lighthouse on the island of Skerry. Remember that, please.",
    "Tonight the fog is thick. What should I check on the lamp first?",
    "How do ships tell one lighthouse from another at night?",
    "Write two lines of a poem about fog.",
    "What is my name, and where do I work?",
]
parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--short", action="store_true", help="a small run, in seconds")
parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="where the model runs (default: cuda when there is one, else cpu)")
args = parser.parse_args()
short = args.short
turns = TURNS[:2] if short else TURNS
model, tokenizer = load_default_model(device=args.device)
chat = ChatSession(model, tokenizer, device_budget=0.25, host_budget=0.5)
twin = ChatSession(model, tokenizer, device_budget=0.25, host_budget=0.5)   # never parked
store = SessionStore(host_bytes=0 if short else 2 * 2**20)                  # a tiny host budget: pushes to disk

for n, text in enumerate(turns, 1):
    if n > 1:
        store.prefetch("ada")   # the user has started typing: read the conversation back from disk meanwhile
        store.resume("ada")     # restored at the turn's first step, from what was read
    reply = chat.ask(text, max_new_tokens=24 if short else 80)
    twin_reply = twin.ask(text, max_new_tokens=24 if short else 80)
    if reply != twin_reply or not torch.equal(chat.ids, twin.ids):   # token for token, not an assert (python -O)
        raise SystemExit("parking changed the conversation")
    store.park("ada", chat.cache)
    s = chat.cache.stats()
    per = s["layers"] * s["kv_heads"]
    print(f"[{n}] you: {text}\n    model: {reply}")
    print("    " + ", ".join(f"{t} {s[t]['tokens'] // per} tok/head ({human_bytes(s[t]['bytes'])})"
                             for t in ("device", "host", "disk")) + f"; parked on {store.where()['ada']}; "
          f"{s['resume_prefetch']['layers']} layer restores read back ahead so far")
print("identical to the never-parked conversation: yes")
store.close()
twin.cache.close()
