"""Rebuild the schema corpus in tests/schemas/ (issue 36: structured-output coverage on real-world schemas).

Two parts:

* tests/schemas/pydantic/*.json: the JSON schemas pydantic writes (`model_json_schema()`) for the models below,
  the kind of models people hand to `response_format` or the openai client's `parse`: nested objects, enums,
  Optional fields, Literal unions, bounded lists, bounded / multiple_of numbers, patterned and bounded strings,
  dates, datetimes, UUIDs, emails, URLs, recursion, bounded dicts, discriminated unions, tuples, sets, Decimals.
  Rebuilt from this file alone, so the part is reproducible for a given pydantic version.
* tests/schemas/packages/*.json: schemas shipped inside packages installed in the venv (`--packages`): found by
  their `"$schema"` key, kept when a model could plausibly be asked to fill them (an object with properties or a
  $ref to one, not too big), deduplicated by content. The file keeps the schema as shipped; sources.json in the
  same folder names the package file each came from.

    .venv/bin/python bench/structured/schema_corpus.py              # pydantic part only
    .venv/bin/python bench/structured/schema_corpus.py --packages   # and re-collect the package part from .venv
    .venv/bin/python bench/structured/schema_corpus.py --corpus /tmp/corpus   # elsewhere (CI's run)
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import re
import sys
import uuid
from decimal import Decimal
from enum import Enum, IntEnum
from pathlib import Path
from typing import Annotated, Any, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "tests" / "schemas"

# pydantic emits `format: email` only for EmailStr, which needs the optional email-validator package: the same
# schema, written without it, keeps the corpus buildable from pydantic alone.
Email = Annotated[str, WithJsonSchema({"type": "string", "format": "email"})]
Url = Annotated[str, WithJsonSchema({"type": "string", "format": "uri", "minLength": 1, "maxLength": 2083})]
IPv4 = Annotated[str, WithJsonSchema({"type": "string", "format": "ipv4"})]

T = TypeVar("T")


# --- people, contacts, organisations ---------------------------------------------------------------------------

class Country(str, Enum):
    US = "US"
    GB = "GB"
    FR = "FR"
    DE = "DE"
    JP = "JP"
    BR = "BR"


class Address(BaseModel):
    street: str = Field(min_length=1, max_length=80)
    city: str = Field(min_length=1, max_length=40)
    postal_code: str = Field(pattern=r"^[0-9]{5}(-[0-9]{4})?$")
    country: Country = Country.US


class Person(BaseModel):
    """A person as an address book stores them."""
    first_name: str = Field(max_length=30)
    last_name: str = Field(max_length=30)
    age: int = Field(ge=0, le=130)
    email: Email
    address: Address | None = None


class ContactCard(BaseModel):
    name: str
    phone: str = Field(pattern=r"^\+[1-9][0-9]{7,14}$", description="E.164 phone number")
    emails: list[Email] = Field(default_factory=list, max_length=3)
    website: Url | None = None
    birthday: dt.date | None = None


class Department(str, Enum):
    engineering = "engineering"
    sales = "sales"
    support = "support"
    finance = "finance"


class Employee(BaseModel):
    id: uuid.UUID
    name: str
    department: Department
    salary: float = Field(gt=0, le=1_000_000)
    start_date: dt.date
    manager_id: uuid.UUID | None = None
    skills: list[str] = Field(default_factory=list, max_length=5)


class OrgUnit(BaseModel):
    """An org chart: a unit and the units under it."""
    name: str
    head: str
    units: list[OrgUnit] = Field(default_factory=list, max_length=4)


class UserProfile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    username: str = Field(pattern=r"^[a-z][a-z0-9_]{2,15}$")
    display_name: str = Field(max_length=50)
    bio: str | None = Field(default=None, max_length=160)
    theme: Literal["light", "dark", "system"] = "system"
    language: str = Field(default="en", pattern=r"^[a-z]{2}(-[A-Z]{2})?$")
    notifications: bool = True


class Resume(BaseModel):
    class Job(BaseModel):
        company: str
        title: str
        start: dt.date
        end: dt.date | None = None
        highlights: list[str] = Field(max_length=3)

    class Education(BaseModel):
        school: str
        degree: Literal["high school", "bachelor", "master", "phd"]
        year: int = Field(ge=1950, le=2030)

    name: str
    summary: str = Field(max_length=300)
    experience: list[Job] = Field(min_length=1, max_length=3)
    education: list[Education] = Field(max_length=2)


# --- commerce ---------------------------------------------------------------------------------------------------

class Currency(str, Enum):
    usd = "USD"
    eur = "EUR"
    gbp = "GBP"
    jpy = "JPY"


class Money(BaseModel):
    amount: Decimal = Field(ge=0, decimal_places=2)
    currency: Currency


class Product(BaseModel):
    sku: str = Field(pattern=r"^[A-Z]{3}-[0-9]{4}$")
    name: str = Field(min_length=2, max_length=60)
    price: Money
    in_stock: bool
    tags: set[str] = Field(default_factory=set, max_length=5)
    rating: float | None = Field(default=None, ge=0, le=5)


class LineItem(BaseModel):
    sku: str
    quantity: int = Field(ge=1, le=100)
    unit_price: float = Field(ge=0)


class Invoice(BaseModel):
    invoice_number: str = Field(pattern=r"^INV-[0-9]{6}$")
    issued: dt.date
    due: dt.date
    customer: Person
    items: list[LineItem] = Field(min_length=1, max_length=5)
    tax_rate: float = Field(ge=0, le=0.5, multiple_of=0.005)
    notes: str | None = None


class OrderStatus(str, Enum):
    pending = "pending"
    paid = "paid"
    shipped = "shipped"
    delivered = "delivered"
    cancelled = "cancelled"


class Order(BaseModel):
    order_id: uuid.UUID
    placed_at: dt.datetime
    status: OrderStatus
    items: list[LineItem] = Field(min_length=1)
    shipping: Address
    gift: bool = False


class ProductReview(BaseModel):
    product: str
    stars: int = Field(ge=1, le=5)
    title: str = Field(max_length=80)
    body: str = Field(max_length=500)
    pros: list[str] = Field(max_length=3)
    cons: list[str] = Field(max_length=3)
    would_recommend: bool


class ShippingLabel(BaseModel):
    tracking_number: str = Field(pattern=r"^1Z[0-9A-Z]{16}$")
    carrier: Literal["UPS", "FedEx", "DHL", "USPS"]
    weight_kg: float = Field(gt=0, le=70)
    dimensions_cm: tuple[int, int, int]
    sender: Address
    recipient: Address


class Coupon(BaseModel):
    code: str = Field(pattern=r"^[A-Z0-9]{6,10}$")
    discount: Annotated[int, Field(ge=5, le=90, multiple_of=5)]
    kind: Literal["percent"] = "percent"
    expires: dt.datetime
    max_uses: int | None = Field(default=None, ge=1)


# --- finance ----------------------------------------------------------------------------------------------------

class Transaction(BaseModel):
    id: uuid.UUID
    timestamp: dt.datetime
    amount: float
    currency: Currency
    direction: Literal["debit", "credit"]
    merchant: str | None = None
    category: Literal["groceries", "rent", "travel", "salary", "utilities", "other"]


class StockQuote(BaseModel):
    ticker: str = Field(pattern=r"^[A-Z]{1,5}$")
    price: float = Field(gt=0)
    change_percent: float = Field(ge=-100, le=1000)
    volume: int = Field(ge=0)
    as_of: dt.datetime


class Budget(BaseModel):
    month: str = Field(pattern=r"^[0-9]{4}-(0[1-9]|1[0-2])$")
    limits: dict[str, float] = Field(max_length=6, description="category -> monthly limit")
    savings_goal: float = Field(ge=0)


class LoanApplication(BaseModel):
    applicant: Person
    amount: int = Field(ge=1000, le=500_000, multiple_of=100)
    term_months: Literal[12, 24, 36, 60, 120, 360]
    purpose: Literal["home", "car", "education", "business", "other"]
    annual_income: float = Field(ge=0)
    employed: bool


# --- scheduling, travel -----------------------------------------------------------------------------------------

class CalendarEvent(BaseModel):
    title: str = Field(max_length=100)
    start: dt.datetime
    end: dt.datetime
    location: str | None = None
    attendees: list[Email] = Field(default_factory=list, max_length=6)
    recurrence: Literal["none", "daily", "weekly", "monthly"] = "none"
    reminder: dt.timedelta | None = None


class Weekday(IntEnum):
    monday = 1
    tuesday = 2
    wednesday = 3
    thursday = 4
    friday = 5
    saturday = 6
    sunday = 7


class OpeningHours(BaseModel):
    day: Weekday
    opens: dt.time
    closes: dt.time


class Restaurant(BaseModel):
    name: str
    cuisine: Literal["italian", "japanese", "mexican", "indian", "french", "other"]
    price_level: int = Field(ge=1, le=4)
    address: Address
    hours: list[OpeningHours] = Field(max_length=7)


class FlightBooking(BaseModel):
    confirmation: str = Field(pattern=r"^[A-Z0-9]{6}$")
    passenger: str
    origin: str = Field(pattern=r"^[A-Z]{3}$", description="IATA airport code")
    destination: str = Field(pattern=r"^[A-Z]{3}$")
    departure: dt.datetime
    cabin: Literal["economy", "premium", "business", "first"]
    seat: str | None = Field(default=None, pattern=r"^[0-9]{1,2}[A-K]$")
    bags: int = Field(default=0, ge=0, le=3)


class ItineraryDay(BaseModel):
    date: dt.date
    city: str
    activities: list[str] = Field(min_length=1, max_length=4)


class TravelItinerary(BaseModel):
    trip_name: str
    travellers: int = Field(ge=1, le=10)
    days: list[ItineraryDay] = Field(min_length=1, max_length=5)
    budget: Money | None = None


class HotelReservation(BaseModel):
    hotel: str
    check_in: dt.date
    check_out: dt.date
    room: Literal["single", "double", "suite"]
    guests: int = Field(ge=1, le=4)
    breakfast: bool
    nightly_rate: float = Field(gt=0)


class MeetingMinutes(BaseModel):
    class ActionItem(BaseModel):
        owner: str
        task: str
        due: dt.date | None = None

    meeting: str
    date: dt.date
    attendees: list[str] = Field(min_length=1, max_length=8)
    decisions: list[str] = Field(max_length=5)
    action_items: list[ActionItem] = Field(max_length=5)


class TodoItem(BaseModel):
    id: int = Field(ge=1)
    text: str = Field(min_length=1, max_length=120)
    done: bool = False
    priority: Literal["low", "medium", "high"] = "medium"
    due: dt.date | None = None


class TodoList(BaseModel):
    title: str
    items: list[TodoItem] = Field(max_length=8)


# --- language tasks (what LLMs are most often asked to fill) --------------------------------------------------

class Sentiment(BaseModel):
    label: Literal["positive", "negative", "neutral"]
    confidence: float = Field(ge=0, le=1)


class Entity(BaseModel):
    text: str
    type: Literal["PERSON", "ORG", "LOCATION", "DATE", "MONEY"]
    start: int = Field(ge=0)
    end: int = Field(ge=0)


class EntityExtraction(BaseModel):
    entities: list[Entity] = Field(max_length=10)


class Citation(BaseModel):
    source_id: int = Field(ge=0)
    quote: str = Field(max_length=200)


class AnswerWithCitations(BaseModel):
    answer: str
    citations: list[Citation] = Field(min_length=1, max_length=3)
    confidence: Literal["low", "medium", "high"]


class Summary(BaseModel):
    title: str = Field(max_length=80)
    bullet_points: list[str] = Field(min_length=3, max_length=5)
    word_count: int = Field(ge=0)


class Translation(BaseModel):
    source_language: str = Field(pattern=r"^[a-z]{2}$")
    target_language: str = Field(pattern=r"^[a-z]{2}$")
    text: str


class Step(BaseModel):
    explanation: str
    output: str


class MathReasoning(BaseModel):
    """The openai cookbook's structured-outputs example."""
    steps: list[Step]
    final_answer: str


class Classification(BaseModel):
    category: Literal["billing", "technical", "account", "sales", "other"]
    urgency: int = Field(ge=1, le=5)
    needs_human: bool
    reason: str = Field(max_length=200)


class Moderation(BaseModel):
    flagged: bool
    categories: list[Literal["hate", "harassment", "self-harm", "sexual", "violence"]] = Field(max_length=5)
    scores: dict[str, float] = Field(max_length=5)


class Triple(BaseModel):
    subject: str
    predicate: str
    object: str


class KnowledgeGraph(BaseModel):
    triples: list[Triple] = Field(min_length=1, max_length=6)


class QuizQuestion(BaseModel):
    question: str
    choices: list[str] = Field(min_length=4, max_length=4)
    answer_index: int = Field(ge=0, le=3)
    difficulty: Literal["easy", "medium", "hard"]


class Quiz(BaseModel):
    topic: str
    questions: list[QuizQuestion] = Field(min_length=1, max_length=3)


class EmailDraft(BaseModel):
    to: list[Email] = Field(min_length=1, max_length=3)
    cc: list[Email] = Field(default_factory=list, max_length=3)
    subject: str = Field(min_length=1, max_length=100)
    body: str
    tone: Literal["formal", "friendly", "urgent"]


class KeywordExtraction(BaseModel):
    keywords: list[Annotated[str, Field(min_length=2, max_length=30)]] = Field(min_length=1, max_length=8)
    language: str = Field(pattern=r"^[a-z]{2}$")


class SearchQuery(BaseModel):
    query: str = Field(min_length=1)
    filters: dict[str, str] = Field(default_factory=dict, max_length=4)
    sort: Literal["relevance", "date", "price_asc", "price_desc"] = "relevance"
    page: int = Field(default=1, ge=1, le=100)
    page_size: Literal[10, 25, 50] = 10


class ChatTurn(BaseModel):
    role: Literal["user", "assistant", "system"]
    content: str


class Conversation(BaseModel):
    turns: list[ChatTurn] = Field(min_length=2, max_length=6)


# --- tool calls / function arguments ---------------------------------------------------------------------------

class GetWeather(BaseModel):
    """Arguments of the canonical get_weather tool."""
    location: str = Field(description="City and country, e.g. Paris, France")
    unit: Literal["celsius", "fahrenheit"] = "celsius"


class SendMessage(BaseModel):
    channel: str = Field(pattern=r"^#[a-z0-9-]{1,30}$")
    text: str = Field(max_length=400)
    thread_ts: str | None = None
    mentions: list[str] = Field(default_factory=list, max_length=5)


class SqlQuery(BaseModel):
    class Condition(BaseModel):
        column: str
        operator: Literal["=", "!=", ">", "<", ">=", "<=", "LIKE", "IN"]
        value: str | int | float | bool | list[str]

    table: str = Field(pattern=r"^[a-z_][a-z0-9_]*$")
    columns: list[str] = Field(min_length=1)
    conditions: list[Condition] = Field(max_length=4)
    order_by: str | None = None
    limit: int = Field(default=100, ge=1, le=1000)


class CreateIssue(BaseModel):
    title: str = Field(min_length=5, max_length=120)
    body: str
    labels: list[Literal["bug", "feature", "docs", "question", "security"]] = Field(max_length=3)
    assignees: list[str] = Field(max_length=2)
    priority: Literal["P0", "P1", "P2", "P3"]


class SetThermostat(BaseModel):
    room: Literal["living room", "bedroom", "kitchen", "office"]
    temperature: float = Field(ge=10, le=30, multiple_of=0.5)
    mode: Literal["heat", "cool", "auto", "off"]


class Page(BaseModel, Generic[T]):
    items: list[T] = Field(max_length=5)
    total: int = Field(ge=0)
    next_cursor: str | None = None


# --- engineering, ops -----------------------------------------------------------------------------------------

class BugReport(BaseModel):
    title: str
    severity: Literal["critical", "major", "minor", "trivial"]
    version: str = Field(pattern=r"^[0-9]+\.[0-9]+\.[0-9]+$")
    steps_to_reproduce: list[str] = Field(min_length=1, max_length=6)
    expected: str
    actual: str
    environment: dict[str, str] = Field(max_length=5)


class CommitMessage(BaseModel):
    type: Literal["feat", "fix", "docs", "refactor", "test", "chore"]
    scope: str | None = Field(default=None, pattern=r"^[a-z-]+$")
    subject: str = Field(max_length=72)
    body: str | None = None
    breaking: bool = False


class CodeReviewComment(BaseModel):
    file: str
    line: int = Field(ge=1)
    severity: Literal["nit", "suggestion", "issue", "blocker"]
    comment: str


class CodeReview(BaseModel):
    verdict: Literal["approve", "request_changes", "comment"]
    comments: list[CodeReviewComment] = Field(max_length=5)
    summary: str


class LogEntry(BaseModel):
    timestamp: dt.datetime
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]
    service: str
    message: str
    request_id: uuid.UUID | None = None
    duration_ms: float | None = Field(default=None, ge=0)


class HttpError(BaseModel):
    """An RFC 9457 problem detail."""
    type: Url = "about:blank"
    title: str
    status: int = Field(ge=400, le=599)
    detail: str | None = None
    instance: str | None = None


class ServerConfig(BaseModel):
    host: IPv4 = "127.0.0.1"
    port: int = Field(ge=1, le=65535)
    workers: int = Field(default=1, ge=1, le=64)
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    tls: bool = False
    allowed_origins: list[Url] = Field(default_factory=list, max_length=4)
    timeout_s: float = Field(default=30.0, gt=0, le=3600)


class FeatureFlag(BaseModel):
    key: str = Field(pattern=r"^[a-z][a-z0-9_.-]*$")
    enabled: bool
    rollout_percent: int = Field(ge=0, le=100)
    variants: dict[str, int] = Field(default_factory=dict, max_length=4)
    expires: dt.date | None = None


class CronJob(BaseModel):
    name: str
    schedule: str = Field(pattern=r"^(\S+ ){4}\S+$", description="a five-field cron expression")
    command: str
    retries: int = Field(default=0, ge=0, le=5)
    enabled: bool = True


class FileNode(BaseModel):
    """A directory tree: files and folders."""
    name: str = Field(min_length=1, max_length=64)
    kind: Literal["file", "directory"]
    size_bytes: int | None = Field(default=None, ge=0)
    children: list[FileNode] = Field(default_factory=list, max_length=5)


class JsonPatchOp(BaseModel):
    op: Literal["add", "remove", "replace", "move", "copy", "test"]
    path: str = Field(pattern=r"^(/[^/]*)*$")
    value: Any = None
    from_: str | None = Field(default=None, alias="from")


class JsonPatch(BaseModel):
    operations: list[JsonPatchOp] = Field(min_length=1, max_length=5)


class SensorReading(BaseModel):
    sensor_id: str = Field(pattern=r"^[A-F0-9]{8}$")
    time: dt.datetime
    temperature_c: float = Field(ge=-40, le=85)
    humidity: float = Field(ge=0, le=100)
    battery: int = Field(ge=0, le=100)
    location: tuple[float, float] | None = None


class DeviceStatus(BaseModel):
    device: uuid.UUID
    online: bool
    ip: IPv4 | None = None
    firmware: str = Field(pattern=r"^v[0-9]+\.[0-9]+$")
    readings: list[SensorReading] = Field(max_length=3)


# --- discriminated unions ---------------------------------------------------------------------------------------

class Circle(BaseModel):
    kind: Literal["circle"]
    radius: float = Field(gt=0)


class Rectangle(BaseModel):
    kind: Literal["rectangle"]
    width: float = Field(gt=0)
    height: float = Field(gt=0)


class Polygon(BaseModel):
    kind: Literal["polygon"]
    points: list[tuple[float, float]] = Field(min_length=3, max_length=6)


class Drawing(BaseModel):
    name: str
    shapes: list[Annotated[Circle | Rectangle | Polygon, Field(discriminator="kind")]] = Field(min_length=1,
                                                                                              max_length=4)


class CardPayment(BaseModel):
    method: Literal["card"]
    last4: str = Field(pattern=r"^[0-9]{4}$")
    brand: Literal["visa", "mastercard", "amex"]


class BankTransfer(BaseModel):
    method: Literal["bank_transfer"]
    iban: str = Field(pattern=r"^[A-Z]{2}[0-9]{2}[A-Z0-9]{11,30}$")


class WalletPayment(BaseModel):
    method: Literal["wallet"]
    provider: Literal["apple_pay", "google_pay", "paypal"]


class Payment(BaseModel):
    amount: Money
    details: CardPayment | BankTransfer | WalletPayment = Field(discriminator="method")


class TextBlock(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ImageBlock(BaseModel):
    type: Literal["image"] = "image"
    url: Url
    alt: str = Field(max_length=120)


class CodeBlock(BaseModel):
    type: Literal["code"] = "code"
    language: Literal["python", "javascript", "sql", "bash"]
    code: str


class Document(BaseModel):
    title: str
    blocks: list[Annotated[TextBlock | ImageBlock | CodeBlock, Field(discriminator="type")]] = Field(max_length=5)


class UiComponent(BaseModel):
    """The openai docs' recursive UI generation example."""
    type: Literal["div", "button", "header", "section", "field", "form"]
    label: str
    children: list[UiComponent] = Field(max_length=4)
    attributes: list[dict[str, str]] = Field(max_length=3)


# --- media, food, health, sport, science ----------------------------------------------------------------------

class Movie(BaseModel):
    title: str
    year: int = Field(ge=1888, le=2030)
    genres: list[Literal["action", "comedy", "drama", "horror", "sci-fi", "romance", "documentary"]] = Field(
        min_length=1, max_length=3)
    director: str
    runtime_minutes: int = Field(ge=1, le=600)
    imdb_rating: float | None = Field(default=None, ge=1, le=10)


class Book(BaseModel):
    isbn: str = Field(pattern=r"^97[89][0-9]{10}$")
    title: str
    authors: list[str] = Field(min_length=1, max_length=4)
    published: dt.date
    pages: int = Field(gt=0)
    language: str = "en"


class Track(BaseModel):
    title: str
    artist: str
    duration_s: int = Field(ge=1, le=3600)


class Playlist(BaseModel):
    name: str
    public: bool
    tracks: list[Track] = Field(min_length=1, max_length=6)


class Ingredient(BaseModel):
    name: str
    quantity: float = Field(gt=0)
    unit: Literal["g", "kg", "ml", "l", "tsp", "tbsp", "cup", "piece"]


class Recipe(BaseModel):
    name: str
    servings: int = Field(ge=1, le=12)
    prep_minutes: int = Field(ge=0, le=600)
    difficulty: Literal["easy", "medium", "hard"]
    ingredients: list[Ingredient] = Field(min_length=2, max_length=8)
    steps: list[str] = Field(min_length=1, max_length=6)
    vegetarian: bool


class NutritionFacts(BaseModel):
    serving_size_g: float = Field(gt=0)
    calories: int = Field(ge=0, le=5000)
    fat_g: float = Field(ge=0)
    carbs_g: float = Field(ge=0)
    protein_g: float = Field(ge=0)
    allergens: list[Literal["gluten", "milk", "eggs", "nuts", "soy", "fish", "shellfish"]] = Field(max_length=7)


class Prescription(BaseModel):
    patient_id: uuid.UUID
    drug: str
    dose_mg: float = Field(gt=0, le=2000)
    frequency: Literal["once daily", "twice daily", "three times daily", "as needed"]
    start: dt.date
    days: int = Field(ge=1, le=365)
    refills: int = Field(default=0, ge=0, le=5)


class LabResult(BaseModel):
    test: str
    value: float
    unit: str
    reference_low: float | None = None
    reference_high: float | None = None
    flag: Literal["low", "normal", "high"] | None = None
    collected_at: dt.datetime


class WeatherForecast(BaseModel):
    class Day(BaseModel):
        date: dt.date
        condition: Literal["sunny", "cloudy", "rain", "snow", "storm", "fog"]
        high_c: float = Field(ge=-60, le=60)
        low_c: float = Field(ge=-60, le=60)
        precipitation_chance: float = Field(ge=0, le=1)

    location: str
    days: list[Day] = Field(min_length=1, max_length=3)


class MatchResult(BaseModel):
    sport: Literal["football", "basketball", "tennis", "cricket"]
    home: str
    away: str
    score: tuple[int, int]
    played_on: dt.date
    venue: str | None = None


class ChessMove(BaseModel):
    move: str = Field(pattern=r"^[a-h][1-8][a-h][1-8][qrbn]?$", description="UCI notation")
    evaluation: float = Field(ge=-100, le=100)
    comment: str | None = None


class GeoPoint(BaseModel):
    type: Literal["Point"] = "Point"
    coordinates: tuple[float, float]


class Feature(BaseModel):
    """A GeoJSON-like feature."""
    type: Literal["Feature"] = "Feature"
    geometry: GeoPoint
    properties: dict[str, str | float | bool | None] = Field(max_length=5)


class City(BaseModel):
    name: str
    country: Country
    population: int = Field(ge=0)
    latitude: float = Field(ge=-90, le=90)
    longitude: float = Field(ge=-180, le=180)
    capital: bool


class ColorPalette(BaseModel):
    name: str
    colors: list[Annotated[str, Field(pattern=r"^#[0-9a-fA-F]{6}$")]] = Field(min_length=3, max_length=5)
    mode: Literal["light", "dark"]


class Vehicle(BaseModel):
    vin: str = Field(pattern=r"^[A-HJ-NPR-Z0-9]{17}$")
    make: str
    model: str
    year: int = Field(ge=1900, le=2030)
    fuel: Literal["petrol", "diesel", "electric", "hybrid"]
    mileage_km: int = Field(ge=0)


class RealEstateListing(BaseModel):
    title: str
    price: Money
    bedrooms: int = Field(ge=0, le=20)
    bathrooms: float = Field(ge=0, le=20, multiple_of=0.5)
    area_m2: float = Field(gt=0)
    address: Address
    features: set[Literal["garden", "garage", "pool", "balcony", "elevator"]]
    listed_on: dt.date


class SurveyResponse(BaseModel):
    respondent: uuid.UUID
    nps: int = Field(ge=0, le=10)
    answers: dict[str, Literal["strongly disagree", "disagree", "neutral", "agree", "strongly agree"]] = Field(
        min_length=1, max_length=5)
    comment: str | None = Field(default=None, max_length=500)


class SocialPost(BaseModel):
    author: str = Field(pattern=r"^@[A-Za-z0-9_]{1,15}$")
    text: str = Field(max_length=280)
    hashtags: list[Annotated[str, Field(pattern=r"^#[A-Za-z0-9_]+$")]] = Field(max_length=5)
    posted_at: dt.datetime
    reply_to: int | None = None


class Comment(BaseModel):
    """A comment thread: a comment and its replies."""
    author: str
    text: str = Field(max_length=200)
    upvotes: int = Field(ge=0)
    replies: list[Comment] = Field(default_factory=list, max_length=3)


class Experiment(BaseModel):
    name: str
    hypothesis: str
    variants: list[Annotated[str, Field(min_length=1)]] = Field(min_length=2, max_length=4)
    traffic_split: list[Annotated[float, Field(ge=0, le=1)]] = Field(min_length=2, max_length=4)
    significance: float = Field(default=0.05, gt=0, lt=1)
    metric: Literal["conversion", "retention", "revenue", "engagement"]


class BinaryAttachment(BaseModel):
    filename: str
    mime_type: Literal["image/png", "image/jpeg", "application/pdf", "text/plain"]
    content: bytes
    size: int = Field(ge=0, le=10_000_000)


class ScheduleSlot(BaseModel):
    start: dt.time
    end: dt.time
    booked: bool


class DoctorSchedule(BaseModel):
    doctor: str
    date: dt.date
    slots: list[ScheduleSlot] = Field(min_length=1, max_length=6)


class Expression(BaseModel):
    """An arithmetic expression tree."""
    op: Literal["+", "-", "*", "/"] | None = None
    value: float | None = None
    left: Expression | None = None
    right: Expression | None = None


class Candidate(BaseModel):
    """A matrix and a vector: nested arrays of numbers."""
    name: str
    weights: list[list[float]] = Field(min_length=1, max_length=3)
    bias: list[float] = Field(min_length=1, max_length=3)


MODELS: list[type[BaseModel]] = [
    Address, Person, ContactCard, Employee, OrgUnit, UserProfile, Resume, Money, Product, Invoice, Order,
    ProductReview, ShippingLabel, Coupon, Transaction, StockQuote, Budget, LoanApplication, CalendarEvent,
    OpeningHours, Restaurant, FlightBooking, TravelItinerary, HotelReservation, MeetingMinutes, TodoList,
    Sentiment, EntityExtraction, AnswerWithCitations, Summary, Translation, MathReasoning, Classification,
    Moderation, KnowledgeGraph, Quiz, EmailDraft, KeywordExtraction, SearchQuery, Conversation, GetWeather,
    SendMessage, SqlQuery, CreateIssue, SetThermostat, Page[Product], BugReport, CommitMessage, CodeReview,
    LogEntry, HttpError, ServerConfig, FeatureFlag, CronJob, FileNode, JsonPatch, SensorReading, DeviceStatus,
    Drawing, Payment, Document, UiComponent, Movie, Book, Playlist, Recipe, NutritionFacts, Prescription,
    LabResult, WeatherForecast, MatchResult, ChessMove, Feature, City, ColorPalette, Vehicle, RealEstateListing,
    SurveyResponse, SocialPost, Comment, Experiment, BinaryAttachment, DoctorSchedule, Expression, Candidate,
]


def snake(name: str) -> str:
    """A file name: CamelCase and acronyms (HTTPOptions, gRPC) split into words, anything else an underscore."""
    out = re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name).lower()
    return re.sub(r"_+", "_", re.sub(r"[^a-z0-9_]", "_", out)).strip("_")


def write_pydantic(corpus: Path) -> int:
    folder = corpus / "pydantic"
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*.json"):
        old.unlink()
    for model in MODELS:
        schema = model.model_json_schema()
        (folder / f"{snake(model.__name__)}.json").write_text(json.dumps(schema, indent=1) + "\n")
    return len(MODELS)


# --- the package part -------------------------------------------------------------------------------------------

MAX_BYTES = 40_000  # larger files are OpenAPI documents, SBOMs or bundles, not a thing to fill in one reply

# pydantic models that installed packages ship for their own configs and API objects: real-world schemas of the
# kind a model is asked to write (a Ray Serve config, an OpenAPI info block, an OpenAI API object).
PACKAGE_MODELS = [
    "ray.serve.schema:AutoscalingConfig", "ray.serve.schema:LoggingConfig", "ray.serve.schema:RayActorOptionsSchema",
    "ray.serve.schema:HTTPOptionsSchema", "ray.serve.schema:gRPCOptionsSchema", "ray.serve.schema:ReplicaDetails",
    "ray.serve.schema:ProxyDetails", "ray.serve.schema:TargetGroup", "ray.serve.schema:DeploymentTopology",
    "ray.serve.schema:TaskProcessorConfig", "ray.serve.schema:ScaleDeploymentRequest",
    "ray.serve.schema:ControllerOptions", "ray.serve.schema:RequestRouterConfig", "ray.serve.schema:TracingConfig",
    "ray.serve.schema:DeploymentAutoscalingDetail", "ray.job_submission:JobDetails",
    "fastapi.openapi.models:Contact", "fastapi.openapi.models:License", "fastapi.openapi.models:Info",
    "fastapi.openapi.models:Server", "fastapi.openapi.models:Tag", "fastapi.openapi.models:OAuthFlows",
    "fastapi.openapi.models:APIKey", "fastapi.openapi.models:HTTPBearer", "fastapi.openapi.models:Link",
    "openai.types:Batch", "openai.types:FileObject", "openai.types:Model", "openai.types:CompletionUsage",
    "openai.types:ErrorObject", "openai.types:FunctionDefinition", "openai.types:ComparisonFilter",
    "openai.types:CompoundFilter", "openai.types:ResponseFormatJSONSchema", "openai.types:VectorStore",
    "openai.types:Upload", "openai.types.chat:ChatCompletionMessage", "openai.types.chat:ChatCompletionTokenLogprob",
    "openai.types.chat:ChatCompletionMessageFunctionToolCall",
]


def local_refs_only(node: Any) -> bool:
    """No $ref outside the file (the 2019-09 and 2020-12 metaschemas are built from remote vocabularies)."""
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and not ref.startswith("#"):
            return False
        return all(local_refs_only(v) for v in node.values())
    if isinstance(node, list):
        return all(local_refs_only(v) for v in node)
    return True


def fillable(schema: Any) -> bool:
    """A self-contained object schema with some properties (or a $ref to a definition): not an SBOM, a template
    or a bare vocabulary metaschema that happens to carry a "$schema" key."""
    if not isinstance(schema, dict) or not local_refs_only(schema):
        return False
    if "$ref" in schema and ("definitions" in schema or "$defs" in schema):
        return True
    props = schema.get("properties")
    return isinstance(props, dict) and len(props) >= 2


def digest(schema: Any) -> str:
    return hashlib.sha256(json.dumps(schema, sort_keys=True).encode()).hexdigest()


def collect_packages(venv: Path, corpus: Path) -> int:
    import importlib
    from importlib.metadata import PackageNotFoundError, packages_distributions, version

    folder = corpus / "packages"
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*.json"):
        old.unlink()
    seen = {digest(json.loads(p.read_text())) for p in (corpus / "pydantic").glob("*.json")}
    distributions = packages_distributions()
    sources: dict[str, str] = {}

    def versioned(top: str) -> str:
        try:
            dist = distributions.get(top, [top])[0]
            return f"{dist} {version(dist)}"
        except PackageNotFoundError:
            return top

    def keep(name: str, schema: Any, source: str) -> None:
        key = digest(schema)
        if key in seen:
            return
        seen.add(key)
        (folder / f"{name}.json").write_text(json.dumps(schema, indent=1) + "\n")
        sources[name] = source

    site = next(venv.glob("lib/python*/site-packages"))
    for path in sorted(site.rglob("*.json")):
        if path.stat().st_size > MAX_BYTES or "/tests/" in str(path):
            continue
        try:
            schema = json.loads(path.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError):
            continue
        if isinstance(schema, dict) and "$schema" in schema and fillable(schema):
            rel = path.relative_to(site)
            name = snake("_".join(rel.parts).removesuffix(".json").replace(".", "_").replace("-", "_"))
            keep(name, schema, f"file {rel} ({versioned(rel.parts[0])})")
    for spec in PACKAGE_MODELS:
        module, _, cls = spec.partition(":")
        model = getattr(importlib.import_module(module), cls)
        name = snake(f"{module.split('.')[0]}_{cls}")
        keep(name, model.model_json_schema(), f"pydantic model {module}.{cls} ({versioned(module.split('.')[0])})")
    (folder / "sources.json").write_text(json.dumps(sources, indent=1, sort_keys=True) + "\n")
    return len(sources)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--packages", action="store_true", help="also re-collect the schemas shipped in the venv")
    parser.add_argument("--venv", type=Path, default=Path(sys.prefix))
    parser.add_argument("--corpus", type=Path, default=CORPUS, help="where the two parts go (default: tests/schemas)")
    args = parser.parse_args()
    print(f"pydantic: {write_pydantic(args.corpus)} schemas")
    if args.packages:
        print(f"packages: {collect_packages(args.venv, args.corpus)} schemas")


if __name__ == "__main__":
    main()
