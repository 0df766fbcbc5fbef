"""A synthetic card-transaction data set with realistic fields and a free-text message per transaction.

Fraud is drawn from a hidden logistic score of the fields and the message's intent, so the tabular models
and the intent LLM each carry part of the signal. Everything is a pure function of the seed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

__all__ = [
    "CHANNELS",
    "FEATURE_NAMES",
    "INTENTS",
    "MERCHANT_CATEGORIES",
    "Transactions",
    "generate_transactions",
    "intent_texts",
    "tabular_features",
]

MERCHANT_CATEGORIES = (
    "grocery", "fuel", "restaurant", "electronics", "travel", "gaming", "jewelry", "crypto",
)  # fmt: skip
CHANNELS = ("pos", "online", "atm", "phone")
UNKNOWN = "<unknown>"

# Each intent is one lowercase word so that " word" is one BPE piece for the intent LLM.
INTENTS = ("purchase", "gift", "refund", "account", "urgent")
_INTENT_FRAUD_LOGIT = {"purchase": -0.6, "gift": 0.2, "refund": 0.0, "account": 1.4, "urgent": 2.2}
_INTENT_PRIOR = (0.46, 0.16, 0.14, 0.12, 0.12)

FEATURE_NAMES: tuple[str, ...] = (
    "amount_log1p",
    "account_age_days_log1p",
    "txn_velocity_1h",
    "country_mismatch",
    "device_change",
    "hour",
    *(f"merchant_category={c}" for c in (*MERCHANT_CATEGORIES, UNKNOWN)),
    *(f"channel={c}" for c in (*CHANNELS, UNKNOWN)),
)

_TEMPLATES: dict[str, tuple[str, ...]] = {
    "purchase": (
        "paying for {item} at the {place}",
        "weekly {item} from the {place}",
        "just my usual {item}",
        "bought {item} for the house",
        "{item} for dinner tonight",
        "card payment for {item}",
        "picked up some {item} on the way home",
        "regular order of {item}",
    ),
    "gift": (
        "birthday present for my {person}",
        "a gift card for my {person}",
        "sending a little something to my {person}",
        "wedding gift for a {person}",
        "surprise for my {person} this weekend",
        "holiday present for the {person}",
        "flowers for my {person}",
    ),
    "refund": (
        "the {item} arrived broken, I want my money back",
        "please refund the {item} order",
        "returning the {item}, it does not fit",
        "charged twice for {item}, need a refund",
        "cancelled the {item} but still got billed",
        "the {place} never delivered my {item}",
    ),
    "account": (
        "I cannot log in, please reset my password",
        "new phone, need to verify my account",
        "someone changed my email address on the account",
        "locked out after too many attempts",
        "update my phone number and security questions",
        "my {person} helped me set up a new device",
        "verification code never arrived on my phone",
    ),
    "urgent": (
        "urgent, send it now before the deadline",
        "my {person} said wire the money immediately",
        "hurry, the {place} will close my account today",
        "investment opportunity, transfer right away",
        "pay the fine now or they will arrest me",
        "the {person} needs the crypto within the hour",
        "act fast, the offer expires in minutes",
    ),
}
_SLOTS: dict[str, tuple[str, ...]] = {
    "item": (
        "groceries", "coffee", "shoes", "a laptop", "headphones", "books", "pizza", "fuel", "a jacket",
        "tickets", "a phone case", "vegetables", "toys", "a lamp", "paint",
    ),
    "place": (
        "supermarket", "bakery", "station", "mall", "bank", "store", "airline", "pharmacy", "market",
    ),
    "person": (
        "sister", "brother", "mother", "father", "friend", "boss", "colleague", "niece", "neighbour",
        "cousin", "son", "daughter",
    ),
}  # fmt: skip


@dataclass(frozen=True)
class Transactions:
    """A generated batch of transactions: raw fields, the message text, its intent and the fraud label."""

    amount: NDArray[np.float64]
    merchant_category: NDArray[np.str_]
    channel: NDArray[np.str_]
    country_mismatch: NDArray[np.float64]
    account_age_days: NDArray[np.float64]
    device_change: NDArray[np.float64]
    txn_velocity_1h: NDArray[np.float64]
    hour: NDArray[np.float64]
    text: list[str]
    intent: list[str]
    is_fraud: NDArray[np.int64]

    def __len__(self) -> int:
        return len(self.text)

    def request_fields(self, i: int, *, text: bool) -> dict[str, Any]:
        """Transaction ``i`` as the keyword arguments of a ``DecideRequest`` (``numeric``, ``categorical``
        and, with ``text``, the customer's message), as the benchmarks and tests send it."""
        row = self.row(i)
        return {
            "numeric": {k: float(v) for k, v in row.items() if isinstance(v, float)},
            "categorical": {k: str(row[k]) for k in ("merchant_category", "channel")},
            "text": str(row["text"]) if text else "",
        }

    def row(self, i: int) -> dict[str, float | str]:
        """One transaction as a request would carry it (numeric and categorical fields, and the text)."""
        return {
            "amount": float(self.amount[i]),
            "account_age_days": float(self.account_age_days[i]),
            "txn_velocity_1h": float(self.txn_velocity_1h[i]),
            "country_mismatch": float(self.country_mismatch[i]),
            "device_change": float(self.device_change[i]),
            "hour": float(self.hour[i]),
            "merchant_category": str(self.merchant_category[i]),
            "channel": str(self.channel[i]),
            "text": self.text[i],
        }


def _fill(template: str, rng: np.random.Generator) -> str:
    values = {slot: options[rng.integers(len(options))] for slot, options in _SLOTS.items()}
    return template.format(**values)


def intent_texts(n: int, seed: int) -> tuple[list[str], list[str]]:
    """``n`` messages and their intents, drawn from the intent prior; a pure function of ``seed``."""
    rng = np.random.default_rng(seed)
    intents = [INTENTS[i] for i in rng.choice(len(INTENTS), size=n, p=_INTENT_PRIOR)]
    texts = []
    for intent in intents:
        templates = _TEMPLATES[intent]
        texts.append(_fill(templates[rng.integers(len(templates))], rng))
    return texts, intents


def generate_transactions(n: int, seed: int) -> Transactions:
    """Generate ``n`` transactions; about 8% are fraud. Deterministic for a given ``seed``."""
    rng = np.random.default_rng(seed)
    texts, intents = intent_texts(n, seed + 7919)
    category = rng.choice(len(MERCHANT_CATEGORIES), size=n, p=(0.28, 0.14, 0.18, 0.12, 0.1, 0.08, 0.05, 0.05))
    channel = rng.choice(len(CHANNELS), size=n, p=(0.5, 0.35, 0.1, 0.05))
    account_age = rng.gamma(shape=1.6, scale=500.0, size=n)
    country_mismatch = (rng.random(n) < 0.07).astype(np.float64)
    device_change = (rng.random(n) < 0.1).astype(np.float64)
    velocity = rng.poisson(1.2, size=n).astype(np.float64)
    hour = rng.integers(0, 24, size=n).astype(np.float64)
    category_scale = np.array([40, 50, 35, 300, 450, 60, 700, 500], dtype=np.float64)
    amount = np.round(category_scale[category] * rng.lognormal(0.0, 0.8, size=n), 2) + 1.0

    risky_category = np.array([-0.5, -0.3, -0.4, 0.5, 0.4, 0.6, 0.9, 1.4])[category]
    risky_channel = np.array([-0.6, 0.5, 0.2, 0.7])[channel]
    night = ((hour <= 4) | (hour >= 23)).astype(np.float64)
    logit = (
        -4.3
        + 0.55 * (np.log1p(amount) - 4.0)
        - 0.5 * (np.log1p(account_age) - 6.0)
        + 0.35 * np.minimum(velocity, 10)
        + 1.6 * country_mismatch
        + 1.2 * device_change
        + 0.6 * night
        + risky_category
        + risky_channel
        + np.array([_INTENT_FRAUD_LOGIT[i] for i in intents])
        + 1.0 * country_mismatch * device_change
    )
    is_fraud = (rng.random(n) < 1.0 / (1.0 + np.exp(-logit))).astype(np.int64)
    # Fraudsters move fast: a fraudulent card shows more transactions in the last hour.
    velocity = velocity + is_fraud * rng.poisson(2.0, size=n)
    return Transactions(
        amount=amount,
        merchant_category=np.array(MERCHANT_CATEGORIES)[category],
        channel=np.array(CHANNELS)[channel],
        country_mismatch=country_mismatch,
        account_age_days=np.round(account_age),
        device_change=device_change,
        txn_velocity_1h=velocity,
        hour=hour,
        text=texts,
        intent=intents,
        is_fraud=is_fraud,
    )


def _one_hot(values: NDArray[np.str_], vocabulary: tuple[str, ...]) -> NDArray[np.float32]:
    index = {v: i for i, v in enumerate(vocabulary)}
    out = np.zeros((len(values), len(vocabulary) + 1), dtype=np.float32)
    out[np.arange(len(values)), [index.get(str(v), len(vocabulary)) for v in values]] = 1.0
    return out


def tabular_features(tx: Transactions) -> NDArray[np.float32]:
    """The demo's feature matrix (columns :data:`FEATURE_NAMES`), float32 and C-contiguous.

    The card-fraud pipeline's feature spec computes exactly these columns from a request.
    """
    numeric = np.column_stack(
        [
            np.log1p(tx.amount),
            np.log1p(tx.account_age_days),
            np.clip(tx.txn_velocity_1h, 0, 50),
            tx.country_mismatch,
            tx.device_change,
            tx.hour,
        ]
    ).astype(np.float32)
    matrix = np.hstack(
        [numeric, _one_hot(tx.merchant_category, MERCHANT_CATEGORIES), _one_hot(tx.channel, CHANNELS)]
    )
    return np.ascontiguousarray(matrix, dtype=np.float32)
