"""Money as an integer number of minor units with an ISO 4217 currency. Never a float."""

from __future__ import annotations

from dataclasses import dataclass

# ISO 4217 minor-unit exponents for the currencies we accept. A currency not listed is refused
# rather than guessed: a wrong exponent would misstate every amount by a factor of ten or more.
CURRENCY_EXPONENTS: dict[str, int] = {
    "AED": 2, "AUD": 2, "BGN": 2, "BHD": 3, "BRL": 2, "CAD": 2, "CHF": 2, "CLP": 0, "CNY": 2,
    "CZK": 2, "DKK": 2, "EUR": 2, "GBP": 2, "HKD": 2, "HUF": 2, "IDR": 2, "ILS": 2, "INR": 2,
    "ISK": 0, "JOD": 3, "JPY": 0, "KRW": 0, "KWD": 3, "MXN": 2, "MYR": 2, "NOK": 2, "NZD": 2,
    "OMR": 3, "PHP": 2, "PLN": 2, "RON": 2, "SAR": 2, "SEK": 2, "SGD": 2, "THB": 2, "TND": 3,
    "TRY": 2, "TWD": 2, "UAH": 2, "USD": 2, "VND": 0, "ZAR": 2,
}
CURRENCY_CHOICES = [(code, code) for code in sorted(CURRENCY_EXPONENTS)]


def currency_exponent(currency: str) -> int:
    try:
        return CURRENCY_EXPONENTS[currency]
    except KeyError:
        raise ValueError(f"{currency!r} is not a supported ISO 4217 currency code") from None


@dataclass(frozen=True, slots=True)
class Money:
    amount_minor: int
    currency: str

    def __post_init__(self) -> None:
        # bool is an int subclass; True is not one cent.
        if type(self.amount_minor) is not int:
            raise TypeError(f"amount_minor must be an int, not {type(self.amount_minor).__name__}")
        currency_exponent(self.currency)

    @property
    def exponent(self) -> int:
        return currency_exponent(self.currency)

    def __str__(self) -> str:
        return format_minor(self.amount_minor, self.currency)


def format_minor(amount_minor: int, currency: str) -> str:
    """``1999, "USD"`` → ``"19.99 USD"``; ``500, "JPY"`` → ``"500 JPY"``; exact, no float."""
    exponent = currency_exponent(currency)
    sign = "-" if amount_minor < 0 else ""
    whole, fraction = divmod(abs(amount_minor), 10**exponent)
    if exponent == 0:
        return f"{sign}{whole:,} {currency}"
    return f"{sign}{whole:,}.{fraction:0{exponent}d} {currency}"
